"""MLflow set-up: a SQLite store and artifacts under <root>/mlruns (STACK-NOTES: no file store)."""

from __future__ import annotations

import logging
from pathlib import Path

from components.config import RegistryConfig


def tracking_uri(mlruns: Path, cfg: RegistryConfig) -> str:
    return cfg.tracking_uri or f"sqlite:///{(mlruns / 'mlflow.db').resolve()}"


def configure_mlflow(mlruns: Path, cfg: RegistryConfig) -> str:
    """Point MLflow at this root's store and make sure the experiment exists; returns its id."""
    level = logging.getLogger().level
    import mlflow  # noqa: PLC0415 - heavy import kept off module import

    logging.getLogger().setLevel(level)  # `import mlflow.pytorch` resets root logging (STACK-NOTES)
    mlruns.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(tracking_uri(mlruns, cfg))
    mlflow.set_registry_uri(tracking_uri(mlruns, cfg))
    experiment = mlflow.get_experiment_by_name(cfg.experiment)
    if experiment is None:
        artifacts = (mlruns / "artifacts").resolve()
        return mlflow.create_experiment(cfg.experiment, artifact_location=artifacts.as_uri())
    return experiment.experiment_id
