"""What every config section shares: ``Section`` (unknown keys are errors) and where the repository is."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent  # components/config/base.py -> the repository
PARAMS_FILE = "params.yaml"


class Section(BaseModel):
    """A config section: unknown keys are errors, so a typo in params.yaml is caught."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def overridden(self, overrides: dict[str, Any], source: str) -> Self:
        """This section with ``overrides`` validated as params.yaml's values are (``model_copy`` would
        take a misspelt key, a wrong type or a broken bound silently); ``ValueError`` naming
        ``source`` (the flag or file they came from), each key and the fix."""
        try:
            return type(self).model_validate({**self.model_dump(), **overrides})
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise ValueError(f"{source} {overrides}: {problems}; fix: use the field names and types of that "
                             f"section of params.yaml") from None
