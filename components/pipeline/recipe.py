"""What a registered model needs kept so that ``fleetloop reproduce`` can rebuild it.

    register_candidate --> lineage/settings.json on the MLflow run (the resolved settings, secrets out)
                       --> store tag model-v<N> on the lineage's LanceDB version (upkeep never prunes
                           it), for the newest ``store.model_versions_kept`` train-task models
    + the lineage tags (commit, DVC snapshot, store version, champion, recipe) and the model itself

The dataset is not copied: its DVC snapshot hash is in the lineage and its files in the DVC cache.
"""

from __future__ import annotations

import logging
from typing import Any

from components.config import SECRET_URI_FIELDS, Settings
from components.pipeline.steps import TRAIN_TASK_RECIPE
from components.pipeline.workspace import Workspace
from components.registry.lineage import Lineage
from components.registry.tracking import redact_uri
from components.store.segment_store import table_exists

log = logging.getLogger(__name__)

SETTINGS_ARTIFACT = "lineage/settings.json"
STORE_TAG = "model-v{version}"


def public_settings(settings: Settings) -> dict[str, Any]:
    """The settings as logged (MLflow params, the settings artifact): no root, no robot tokens,
    store URIs without their passwords."""
    body = settings.model_dump(mode="json", exclude={"root": True, "runtime": {"tokens"}})
    for section, key in SECRET_URI_FIELDS:
        body[section][key] = redact_uri(body[section][key])
    return body


def keep_store_version(settings: Settings, version: int, lineage: Lineage) -> str | None:
    """Tag the segment-store version ``lineage`` read as ``model-v<version>``, for the models
    ``fleetloop reproduce`` can rebuild (the train task's: one per retrain, not one per fleet
    candidate); None when there is nothing to keep. A failure is logged, not raised: the model is
    registered already."""
    tag = STORE_TAG.format(version=version)
    ws = Workspace(settings)
    if lineage.recipe != TRAIN_TASK_RECIPE or lineage.lancedb_version < 0:
        return None
    try:
        if not table_exists(ws.store_location, settings.store.table):
            return None
        ws.store.tag(tag, lineage.lancedb_version)
        for old in model_tags(ws.store.tags())[: -settings.store.model_versions_kept]:
            ws.store.untag(old)
    except Exception as exc:  # noqa: BLE001 - lancedb raises ValueError/OSError/RuntimeError by backend
        log.warning("could not tag store version %d as %s (upkeep may prune it; `fleetloop reproduce %d` "
                    "then cannot rebuild this model): %s", lineage.lancedb_version, tag, version, exc)
        return None
    return tag


def model_tags(tags: dict[str, int]) -> list[str]:
    """The store's model-v<N> tags, oldest model first."""
    prefix = STORE_TAG.format(version="")
    numbered = [(int(name[len(prefix):]), name) for name in tags if name.startswith(prefix) and name[len(prefix):].isdigit()]
    return [name for _, name in sorted(numbered)]
