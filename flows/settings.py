"""Flow-side environment: Prefect home and result storage under the one root."""

from __future__ import annotations

import os

from components.config import Settings, load_settings


def prepare_environment(settings: Settings | None = None) -> Settings:
    """Load settings and point Prefect's home/results at ``<root>/.prefect`` unless the user set them."""
    settings = settings or load_settings()
    home = settings.paths.prefect_home
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "storage"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    return settings
