"""Who may be reported on: the three disjoint robot populations of a study (DESIGN.md, evaluation protocol).

    robot ids --role by id prefix (fleet config)--> refused unless *test* --> test report

*Tuning* robots are the only ones a setting may be chosen on, *validation* robots select rounds
and gate promotions, *test* robots are reported only: a figure measured on a robot that took part
in any decision is not a figure about new robots. A robot's role is its id's prefix
(``fleet.*_prefix``, checked distinct in the config); its quirks come from (``sim.population_seed``,
id), so a test population is fresh when its population seed is (``fleet.test_population_seed``).
Collection robots (trained on) and the product gate's held-out robots (the study settings were
tuned on them) are refused as well.
"""

from __future__ import annotations

from components.config import EvaluationConfig, FleetConfig, SimConfig
from components.episodes.record import Episode
from components.evaluation.heldout import EvaluationReport, summarize
from components.sim.collect import Policy, run_episodes

REPORTABLE_ROLE = "test"
TUNING_ROLE = "tuning"


class UsedRobotError(ValueError):
    """A report was asked for on a robot that took part in a decision (or has no role)."""


def robot_role(robot_id: str, fleet: FleetConfig) -> str | None:
    """The role whose prefix the id carries (``<prefix>-NNNN``); None for ids of no role."""
    for role, prefix in fleet.role_prefixes().items():
        if robot_id.startswith(f"{prefix}-"):
            return role
    return None


def _require_role(robot_ids: list[str], fleet: FleetConfig, role: str, empty: str, refusal: str) -> None:
    """Raise unless every robot has ``role``: ``empty`` when none is given, else ``UsedRobotError``
    with ``refusal`` formatted with the robot (repr) and what it is (its role, or no role)."""
    if not robot_ids:
        raise ValueError(empty)
    for robot in robot_ids:
        found = robot_role(robot, fleet)
        if found != role:
            used = f"a {found} robot" if found else "a robot of no role"
            raise UsedRobotError(refusal.format(robot=repr(robot), used=used, prefix=repr(robot.split("-")[0])))


def check_reportable(robot_ids: list[str], fleet: FleetConfig) -> None:
    """Refuse any robot that is not a test robot, naming the robot, its role and the fix."""
    _require_role(
        robot_ids, fleet, REPORTABLE_ROLE,
        "no robots to report on: pass test robots, e.g. settings.fleet.test_ids(16)",
        f"refusing to report on {{robot}}: it is {{used}} (prefix {{prefix}}), and only {REPORTABLE_ROLE} robots, "
        f"never used for tuning, validation or collection, may be reported; fix: evaluate on fleet.test_ids(n) "
        f"({fleet.test_prefix}-NNNN) with a fresh population seed (fleet.test_population_seed(study seed))",
    )


def check_tuning_robots(robot_ids: list[str], fleet: FleetConfig) -> None:
    """Settings are chosen on tuning robots only: refuse any other robot, naming it and the fix."""
    _require_role(
        robot_ids, fleet, TUNING_ROLE,
        "no robots to tune on: pass tuning robots, e.g. settings.fleet.tuning_ids(16)",
        f"refusing to tune on {{robot}}: it is {{used}}, and settings may be chosen on {TUNING_ROLE} robots only; "
        f"fix: evaluate on fleet.tuning_ids(n) ({fleet.tuning_prefix}-NNNN)",
    )


def check_decision_robots(robot_ids: list[str], fleet: FleetConfig) -> None:
    """The other side of the protocol: a decision (gate, selection) never looks at a test robot."""
    for robot in robot_ids:
        if robot_role(robot, fleet) == REPORTABLE_ROLE:
            raise UsedRobotError(
                f"refusing to decide on {robot!r}: it is a {REPORTABLE_ROLE} robot, reported only; "
                f"fix: gate and select on validation robots (fleet.heldout_prefix / fleet.validation_ids)"
            )


def evaluate_test(
    policy: Policy,
    robot_ids: list[str],
    population_seed: int,
    sim_cfg: SimConfig,
    fleet_cfg: FleetConfig,
    eval_cfg: EvaluationConfig,
    trials_per_robot: int,
    seed: int,
    policy_version: str,
) -> EvaluationReport:
    """The reported figure: seeded trials on test robots of population ``population_seed``.

    Raises ``UsedRobotError`` before any rollout if a robot is not a test robot."""
    check_reportable(robot_ids, fleet_cfg)
    population = sim_cfg.model_copy(update={"population_seed": population_seed})
    episodes = run_episodes(policy, robot_ids, population, trials_per_robot, seed, policy_version)
    return summarize(episodes, population, eval_cfg.confidence, policy_version)


def tuning_episodes(
    policy: Policy,
    robot_ids: list[str],
    sim_cfg: SimConfig,
    fleet_cfg: FleetConfig,
    trials_per_robot: int,
    seed: int,
    policy_version: str,
) -> list[Episode]:
    """Seeded trials on tuning robots of the sim's own population, as episodes (``evaluate_tuning``
    summarizes them; a diagnostic reads them frame by frame). Raises ``UsedRobotError`` before any
    rollout if a robot is not a tuning robot."""
    check_tuning_robots(robot_ids, fleet_cfg)
    return run_episodes(policy, robot_ids, sim_cfg, trials_per_robot, seed, policy_version)


def evaluate_tuning(
    policy: Policy,
    robot_ids: list[str],
    sim_cfg: SimConfig,
    fleet_cfg: FleetConfig,
    eval_cfg: EvaluationConfig,
    trials_per_robot: int,
    seed: int,
    policy_version: str,
) -> EvaluationReport:
    """The figure a setting is chosen on: seeded trials on tuning robots of the sim's own population
    (``sim.population_seed``; test populations are drawn apart from it). Raises ``UsedRobotError``
    before any rollout if a robot is not a tuning robot."""
    episodes = tuning_episodes(policy, robot_ids, sim_cfg, fleet_cfg, trials_per_robot, seed, policy_version)
    return summarize(episodes, sim_cfg, eval_cfg.confidence, policy_version)
