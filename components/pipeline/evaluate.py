"""Evaluate step: the same seeded trials on robots held out of collection, for every model.

Each robot has its own random streams, so rolling robots out in groups (a flow's fan-out) gives
exactly the episodes one vectorized run over all of them would.
"""

from __future__ import annotations

from components.config import Settings
from components.episodes.record import Episode
from components.evaluation.heldout import EvaluationReport, Trial, summarize
from components.evaluation.populations import check_decision_robots, evaluate_test
from components.pipeline.collect import fleet_actor
from components.policy.normalizer import NormalizedPolicy
from components.sim.collect import run_episodes

EVAL_SEED_OFFSET = 7919  # keeps evaluation streams apart from collection streams of the same seed


def trials_per_robot(settings: Settings) -> int:
    """Enough trials per held-out robot that the task gets ``evaluation.trials_per_task`` in all."""
    return settings.evaluation.trials_for(settings.fleet.num_heldout_robots)


def robot_groups(settings: Settings) -> list[list[str]]:
    """The gate's robots (``fleet.heldout_ids()``) in groups; never test robots (a decision)."""
    robots = settings.fleet.heldout_ids()
    check_decision_robots(robots, settings.fleet)
    size = max(1, settings.ops.eval_robots_per_task)
    return [robots[i : i + size] for i in range(0, len(robots), size)]


def rollouts(settings: Settings, policy: NormalizedPolicy, robot_ids: list[str], version: str) -> list[Episode]:
    actor = fleet_actor(settings, policy, seed=settings.seed, explore=settings.evaluation.sample_gripper, motion=False)
    return run_episodes(
        actor, robot_ids, settings.sim, trials_per_robot(settings),
        seed=settings.seed + EVAL_SEED_OFFSET, policy_version=version,
    )


def trials(settings: Settings, policy: NormalizedPolicy, robot_ids: list[str], version: str) -> list[Trial]:
    """``rollouts`` reduced to what a report reads: what the evaluate flow's cached tasks keep."""
    return [Trial.of(ep) for ep in rollouts(settings, policy, robot_ids, version)]


def report(settings: Settings, episodes: list[Episode] | list[Trial], version: str) -> EvaluationReport:
    return summarize(episodes, settings.sim, settings.evaluation.confidence, version)


def evaluate_policy(settings: Settings, policy: NormalizedPolicy, version: str) -> EvaluationReport:
    """All held-out robots in one process."""
    episodes = [ep for group in robot_groups(settings) for ep in rollouts(settings, policy, group, version)]
    return report(settings, episodes, version)


def evaluate_on_test_robots(
    settings: Settings, policy: NormalizedPolicy, version: str, robots: int, population_seed: int
) -> EvaluationReport:
    """A reported figure: ``robots`` test robots of sim population ``population_seed`` (fresh robots
    nobody tuned, selected or gated on), the policy executed as deployed (``evaluation.sample_gripper``),
    at least ``evaluation.trials_per_task`` trials. The same (settings, population) gives the same trials."""
    check_policy_fits_sim(policy, settings, version)
    actor = fleet_actor(settings, policy, seed=settings.seed, explore=settings.evaluation.sample_gripper, motion=False)
    return evaluate_test(
        actor, settings.fleet.test_ids(robots), population_seed, settings.sim, settings.fleet, settings.evaluation,
        settings.evaluation.trials_for(robots), settings.seed + EVAL_SEED_OFFSET, version,
    )


def check_policy_cameras(policy: NormalizedPolicy, settings: Settings, version: str) -> None:
    """A vision model needs the simulator to render the cameras it was trained on, at that size."""
    from components.episodes.record import CAMERA_KEY_PREFIX

    rendered = {CAMERA_KEY_PREFIX + view for view in settings.sim.cameras}
    size = (settings.sim.camera.height, settings.sim.camera.width)
    for cam in policy.layout.cameras:
        if cam.key not in rendered or (cam.height, cam.width) != size:
            raise PolicySimMismatch(
                f"model {version} sees camera {cam.key} at {cam.width}x{cam.height} but the simulator renders "
                f"{sorted(rendered) or 'no camera'} at {size[1]}x{size[0]}",
                f"run it with FLEETLOOP_SIM__CAMERAS='[\"{cam.key.removeprefix(CAMERA_KEY_PREFIX)}\"]' and "
                f"sim.camera.width/height = {cam.width}/{cam.height}",
            )


class PolicySimMismatch(ValueError):
    """A model's observation size is not the simulator's: it was trained in another one."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message}; {fix}")
        self.message, self.fix = message, fix


def check_policy_fits_sim(policy: NormalizedPolicy, settings: Settings, version: str) -> None:
    """A model trained in another simulator fails deep in torch with a shape error; say which
    simulator its observations fit instead, and how to pick it."""
    from typing import get_args

    from components.config import SimConfig
    from components.sim.factory import observation_dim

    ours = observation_dim(settings.sim)
    check_policy_cameras(policy, settings, version)
    if policy.state_dim == ours:
        return
    fits = [name for name in get_args(SimConfig.model_fields["name"].annotation)
            if observation_dim(settings.sim.model_copy(update={"name": name})) == policy.state_dim]
    raise PolicySimMismatch(
        f"model {version} takes {policy.state_dim}-dim observations but sim.name={settings.sim.name} gives {ours}",
        f"evaluate it in the simulator it was trained in: FLEETLOOP_SIM__NAME={fits[0]}" if fits
        else "no simulator here gives that size: check the model URI",
    )
