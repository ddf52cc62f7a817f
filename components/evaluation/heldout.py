"""Evaluate a policy on robots held out of collection: success with a Wilson CI, failures by stage and robot."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from components.config import EvaluationConfig, SimConfig
from components.episodes.record import Episode
from components.evaluation.intervals import Proportion, wilson_interval
from components.sim.collect import Policy, run_episodes
from components.sim.pickplace import STAGES


@dataclass(frozen=True)
class EvaluationReport:
    overall: Proportion
    by_robot: dict[str, Proportion]
    failures_by_stage: dict[str, int]
    policy_version: str
    trials_per_robot: int
    robots: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.overall.rate

    def to_dict(self) -> dict:
        return {
            "policy_version": self.policy_version,
            "success_rate": self.overall.rate,
            "ci_low": self.overall.low,
            "ci_high": self.overall.high,
            "successes": self.overall.successes,
            "trials": self.overall.trials,
            "trials_per_robot": self.trials_per_robot,
            "failures_by_stage": dict(self.failures_by_stage),
            "by_robot": {r: {"successes": p.successes, "trials": p.trials} for r, p in self.by_robot.items()},
        }


def summarize(episodes: list[Episode], sim_cfg: SimConfig, confidence: float, policy_version: str) -> EvaluationReport:
    """Aggregate finished episodes into a report (also used for fleet-collected episodes)."""
    stages = STAGES
    robots = sorted({ep.robot_id for ep in episodes})
    by_robot = {}
    for robot in robots:
        mine = [ep for ep in episodes if ep.robot_id == robot]
        by_robot[robot] = wilson_interval(sum(ep.success for ep in mine), len(mine), confidence)
    failures = Counter(
        stages[ep.stage_reached] if 0 <= ep.stage_reached < len(stages) else "unknown"
        for ep in episodes
        if not ep.success
    )
    overall = wilson_interval(sum(ep.success for ep in episodes), len(episodes), confidence)
    per_robot = len(episodes) // max(1, len(robots))
    return EvaluationReport(overall, by_robot, dict(failures), policy_version, per_robot, robots)


def evaluate_heldout(
    policy: Policy,
    robot_ids: list[str],
    sim_cfg: SimConfig,
    eval_cfg: EvaluationConfig,
    seed: int,
    policy_version: str,
) -> EvaluationReport:
    episodes = run_episodes(policy, robot_ids, sim_cfg, eval_cfg.trials_per_robot, seed, policy_version)
    return summarize(episodes, sim_cfg, eval_cfg.confidence, policy_version)
