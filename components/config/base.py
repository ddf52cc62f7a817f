"""What every config section shares: ``Section`` (unknown keys are errors) and where the repository is."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent.parent  # components/config/base.py -> the repository
PARAMS_FILE = "params.yaml"


class Section(BaseModel):
    """A config section: unknown keys are errors, so a typo in params.yaml is caught."""

    model_config = ConfigDict(extra="forbid", frozen=True)
