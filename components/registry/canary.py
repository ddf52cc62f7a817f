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
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from components.config import FleetRuntimeConfig, RegistryConfig

if TYPE_CHECKING:  # heavy (mlflow, pyarrow); the inference hot path only needs assigned_alias
    from components.episodes.dataset import EpisodeDataset
    from components.registry.model_registry import PolicyRegistry

log = logging.getLogger(__name__)

HASH_SCALE = float(2**64)
START_TAG = "fleetloop.canary.start_episode_index"
DECISION_TAG = "fleetloop.canary.decision"


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


class CanaryRollout:
    """Start, judge and finish canary rollouts against the registry and the live episode dataset."""

    def __init__(self, registry: "PolicyRegistry", dataset: "EpisodeDataset", cfg: FleetRuntimeConfig) -> None:
        self.registry = registry
        self.dataset = dataset
        self.cfg = cfg
        self.reg: RegistryConfig = registry.cfg

    # ------------------------------------------------------------------ state
    def live(self) -> int | None:
        """The canary version being rolled out, if any."""
        return self.registry.aliases().get(self.cfg.canary_alias)

    def start(self, version: int) -> CanaryDecision:
        """Roll ``version`` out to ``canary_share`` of the fleet (straight to champion if there is none)."""
        champion = self.registry.champion()
        if champion is None or self.cfg.canary_share <= 0:
            self.registry.set_champion(version)
            reason = "no champion yet" if champion is None else "canary_share is 0: promoted directly"
            decision = CanaryDecision("promote", None, None, reason)
            self._log(version, champion.version if champion else None, decision)
            return decision
        self.dataset.refresh()
        name = self.reg.model_name
        self.registry.client.set_model_version_tag(name, str(version), START_TAG, str(self.dataset.num_episodes))
        self.registry.client.set_registered_model_alias(name, self.cfg.canary_alias, str(version))
        decision = CanaryDecision(
            "start", None, None, f"v{version} serves {100 * self.cfg.canary_share:.0f}% of the fleet; champion v{champion.version}"
        )
        self._log(version, champion.version, decision)
        return decision

    def outcomes(self, version: int, since_episode: int) -> ArmOutcomes:
        """Live labels of ``version`` from episodes stored since the rollout began."""
        index = self.dataset.episode_index()
        if index.num_rows == 0 or "policy_version" not in index.column_names:
            return ArmOutcomes(version, 0, 0, 0)
        position = np.asarray(index.column("episode_index").to_numpy())
        mine = np.asarray(index.column("policy_version").to_pylist()) == f"v{version}"
        mine &= position >= since_episode
        interrupted = np.asarray(index.column("interrupted").to_pylist(), dtype=bool)
        success = np.asarray(index.column("success").to_pylist(), dtype=bool)
        counted = mine & ~interrupted
        return ArmOutcomes(version, int((success & counted).sum()), int(counted.sum()), int((mine & interrupted).sum()))

    # ------------------------------------------------------------------ decision
    def evaluate(self) -> CanaryDecision:
        """Judge the live canary; promotes or rolls back when the evidence (or the budget) says so."""
        from components.registry.gate import two_proportion_gate

        canary = self.live()
        champion = self.registry.champion()
        if canary is None:
            return CanaryDecision("none", None, None, "no canary is live")
        if champion is None or champion.version == canary:
            return self._finish("promote", canary, None, None, None, "no other champion to compare with")
        self.dataset.refresh()
        since = int(self.registry.get_version(canary).tags.get(START_TAG, "0"))
        arm = self.outcomes(canary, since)
        base = self.outcomes(champion.version, since)
        alpha, need = self.reg.gate_alpha, self.cfg.canary_min_episodes
        if arm.trials >= need and base.trials >= need:
            better = two_proportion_gate(arm.successes, arm.trials, base.successes, base.trials, alpha)
            if better.promote:
                return self._finish("promote", canary, arm, base, better.p_value, f"canary {better.reason}")
            worse = two_proportion_gate(base.successes, base.trials, arm.successes, arm.trials, alpha)
            if worse.promote:
                return self._finish("rollback", canary, arm, base, worse.p_value, f"champion {worse.reason}")
            if arm.trials >= self.cfg.canary_max_episodes:
                reason = f"not significantly better after {arm.trials} episodes (budget {self.cfg.canary_max_episodes}): {better.reason}"
                return self._finish("rollback", canary, arm, base, better.p_value, reason)
            return CanaryDecision("wait", arm, base, f"undecided: {better.reason}", better.p_value)
        if arm.trials >= self.cfg.canary_max_episodes:
            return self._finish("rollback", canary, arm, base, None, f"champion arm has only {base.trials} episodes after the canary's budget")
        return CanaryDecision("wait", arm, base, f"collecting: canary {arm.trials}, champion {base.trials} of {need} episodes each")

    def _finish(
        self, action: str, canary: int, arm: ArmOutcomes | None, base: ArmOutcomes | None, p_value: float | None, reason: str
    ) -> CanaryDecision:
        name = self.reg.model_name
        champion = self.registry.champion()
        if action == "promote":
            self.registry.set_champion(canary)
        self.registry.client.delete_registered_model_alias(name, self.cfg.canary_alias)
        self.registry.client.set_model_version_tag(name, str(canary), DECISION_TAG, f"{action}: {reason}"[:4900])
        if action == "rollback":
            self.registry.client.set_model_version_tag(name, str(canary), "fleetloop.rolled_back", "true")
        decision = CanaryDecision(action, arm, base, reason, float("nan") if p_value is None else p_value)
        self._log(canary, champion.version if champion else None, decision)
        log.info("canary v%d: %s (%s)", canary, action, reason)
        return decision

    def _log(self, canary: int, champion: int | None, decision: CanaryDecision) -> None:
        """One MLflow run per decision (start, promote, rollback) in the registry's experiment."""
        mlflow = self.registry._mlflow
        with mlflow.start_run(experiment_id=self.registry.experiment_id, run_name=f"canary-v{canary}-{decision.action}"):
            mlflow.set_tags({DECISION_TAG: decision.action, "fleetloop.canary.reason": decision.reason[:4900]})
            mlflow.log_params(
                {
                    "canary_version": canary, "champion_version": champion, "canary_share": self.cfg.canary_share,
                    "min_episodes": self.cfg.canary_min_episodes, "max_episodes": self.cfg.canary_max_episodes,
                    "alpha": self.reg.gate_alpha,
                }
            )
            metrics: dict[str, float] = {}
            for prefix, arm in (("canary", decision.canary), ("champion", decision.champion)):
                if arm is not None:
                    metrics.update({f"{prefix}_successes": arm.successes, f"{prefix}_trials": arm.trials, f"{prefix}_interrupted": arm.interrupted})
                    if arm.trials:
                        metrics[f"{prefix}_success_rate"] = arm.rate
            if not np.isnan(decision.p_value):
                metrics["p_value"] = decision.p_value
            if metrics:
                mlflow.log_metrics(metrics)
            mlflow.log_dict(
                {"decision": asdict(decision), "canary": canary, "champion": champion}, "canary_decision.json"
            )
