"""`rollback`: the previous champion becomes champion again (one registry operation, logged)."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from components.config import Settings
from components.pipeline.workspace import Workspace
from components.registry.model_registry import PolicyVersion
from flows.runtime import prepare_environment


@flow(name="rollback")
def rollback(settings: Settings | None = None) -> PolicyVersion:
    settings = prepare_environment(settings)
    registry = Workspace(settings).registry
    before = registry.champion()
    restored = registry.rollback()
    message = f"rolled back: champion v{before.version if before else '-'} → v{restored.version}"
    get_run_logger().info(message)
    create_markdown_artifact(f"# fleetloop rollback\n\n{message}", key="rollback", description="champion rollback")
    return restored
