"""Evaluate a policy on robots held out of collection.

    policy + held-out robot ids --seeded trials (every model gets the same ones: paired)-->
    EvaluationReport: success with a Wilson CI, per robot, failures by stage and by robot

Held-out robots never collect training data, so their quirks (placement, gain, bias, noise) are
new to the policy: the figure measures generalization across the fleet, not memorization.
Each task gets at least ``evaluation.trials_per_task`` trials (120 by default, as a real fleet
evaluation), spread over the held-out robots.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from components.config import EvaluationConfig, SimConfig
from components.episodes.record import Episode
from components.evaluation.intervals import Proportion, wilson_interval
from components.sim.collect import Policy, run_episodes
from components.sim.factory import stages as sim_stages
from components.sim.pickplace import STAGES

UNKNOWN_STAGE = "unknown"  # episodes without stage diagnostics (no per-frame stage column: real robots, imports)


@dataclass(frozen=True)
class Trial:
    """What a report reads of one finished episode: a few bytes where the episode is its frames
    (a cached evaluation keeps these, never the rollouts' observations)."""

    robot_id: str
    task: str
    success: bool
    stage_reached: int = -1

    @classmethod
    def of(cls, episode: Episode) -> Trial:
        return cls(episode.robot_id, episode.task, bool(episode.success), int(episode.stage_reached))


@dataclass(frozen=True)
class EvaluationReport:
    overall: Proportion
    by_robot: dict[str, Proportion]
    failures_by_stage: dict[str, int]
    policy_version: str
    trials_per_robot: int
    robots: list[str] = field(default_factory=list)
    failures_by_robot: dict[str, dict[str, int]] = field(default_factory=dict)  # robot -> stage -> count
    by_task: dict[str, Proportion] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.overall.rate

    def to_dict(self) -> dict:
        return {
            "policy_version": self.policy_version,
            "success_rate": self.overall.rate,
            "ci_low": self.overall.low,
            "ci_high": self.overall.high,
            "confidence": self.overall.confidence,
            "successes": self.overall.successes,
            "trials": self.overall.trials,
            "trials_per_robot": self.trials_per_robot,
            "failures_by_stage": dict(self.failures_by_stage),
            "failures_by_robot": {r: dict(s) for r, s in self.failures_by_robot.items()},
            "by_robot": {r: {"successes": p.successes, "trials": p.trials} for r, p in self.by_robot.items()},
            "by_task": {t: {"successes": p.successes, "trials": p.trials} for t, p in self.by_task.items()},
        }


def stage_name(episode: Episode | Trial, stages: tuple[str, ...] = STAGES) -> str:
    """The furthest stage a (failed) episode reached, by name."""
    return stages[episode.stage_reached] if 0 <= episode.stage_reached < len(stages) else UNKNOWN_STAGE


def summarize(
    episodes: list[Episode] | list[Trial],
    sim_cfg: SimConfig,
    confidence: float,
    policy_version: str,
    stages: tuple[str, ...] | None = None,
) -> EvaluationReport:
    """Aggregate finished episodes into a report (also used for fleet-collected episodes); stage
    names are the simulator's (``sim_cfg``) unless given."""
    if not episodes:
        raise ValueError("no episodes to summarize: run at least one trial per held-out robot")
    stages = sim_stages(sim_cfg) if stages is None else stages
    robots = sorted({ep.robot_id for ep in episodes})
    by_robot, failures_by_robot = {}, {}
    for robot in robots:
        mine = [ep for ep in episodes if ep.robot_id == robot]
        by_robot[robot] = wilson_interval(sum(ep.success for ep in mine), len(mine), confidence)
        failed = Counter(stage_name(ep, stages) for ep in mine if not ep.success)
        if failed:
            failures_by_robot[robot] = dict(failed)
    by_task = {}
    for task in sorted({ep.task for ep in episodes}):
        mine = [ep for ep in episodes if ep.task == task]
        by_task[task] = wilson_interval(sum(ep.success for ep in mine), len(mine), confidence)
    failures = Counter(stage_name(ep, stages) for ep in episodes if not ep.success)
    overall = wilson_interval(sum(ep.success for ep in episodes), len(episodes), confidence)
    per_robot = len(episodes) // len(robots)
    return EvaluationReport(
        overall, by_robot, dict(failures), policy_version, per_robot, robots, failures_by_robot, by_task
    )


def evaluate_heldout(
    policy: Policy,
    robot_ids: list[str],
    sim_cfg: SimConfig,
    eval_cfg: EvaluationConfig,
    seed: int,
    policy_version: str,
) -> EvaluationReport:
    """Seeded trials on the held-out robots: at least ``trials_per_task`` in all."""
    trials = eval_cfg.trials_for(len(robot_ids))
    episodes = run_episodes(policy, robot_ids, sim_cfg, trials, seed, policy_version)
    return summarize(episodes, sim_cfg, eval_cfg.confidence, policy_version)
