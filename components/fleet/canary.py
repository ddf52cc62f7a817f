"""Canary rollout: a newly promoted model first serves a share of the fleet, then is kept or undone.

    start(version)  -> alias ``canary`` = version; the robots whose stable hash falls below
                       ``canary_share`` are served it (the rest keep the champion)
    evaluate()      -> live outcome labels of both arms since the start (episodes in the dataset,
                       interrupted ones left out) -> the registry's one-sided two-proportion gate:
                         canary significantly better        -> champion (previous kept for rollback)
                         canary significantly worse, or not
                         better once its budget is spent    -> rolled back (alias removed)
                         otherwise                          -> keep collecting
Every decision is an MLflow run (params, metrics, the gate's reason) and a model-version tag.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from components.config import FleetRuntimeConfig, RegistryConfig

log = logging.getLogger(__name__)

HASH_SCALE = float(2**64)
START_TAG = "fleetloop.canary.start_episode_index"
DECISION_TAG = "fleetloop.canary.decision"
STATE_FILE = "canary.json"


def rollout_fraction(robot_id: str) -> float:
    """A robot's stable position in [0, 1): the same robots stay canaries across restarts."""
    digest = hashlib.blake2b(robot_id.encode(), digest_size=8, person=b"fleet-canary").digest()
    return int.from_bytes(digest, "big") / HASH_SCALE


def assigned_alias(robot_id: str, share: float, canary_live: bool, cfg: RegistryConfig, canary_alias: str) -> str:
    """Which alias serves ``robot_id``: the canary for the first ``share`` of the fleet, if one is live."""
    if canary_live and rollout_fraction(robot_id) < share:
        return canary_alias
    return cfg.champion_alias


@dataclass(frozen=True)
class ArmOutcomes:
    """Live outcome labels of one arm (one model version) since the canary started."""

    version: int
    successes: int
    trials: int
    interrupted: int

    @property
    def rate(self) -> float:
        return self.successes / self.trials if self.trials else float("nan")


@dataclass(frozen=True)
class CanaryDecision:
    """What ``evaluate`` concluded; ``action`` is promote | rollback | wait | none."""

    action: str
    canary: ArmOutcomes | None
    champion: ArmOutcomes | None
    reason: str
    p_value: float = float("nan")
