"""`fleet_round`: the fleet runs ``@champion`` for a fixed time per robot, then `retrain` on what it did."""

from __future__ import annotations

from prefect import flow, get_run_logger, task

from components.config import Settings
from components.pipeline import collect as step
from components.pipeline import loop
from components.pipeline.promote import PromotionOutcome
from flows.retrain import retrain
from flows.runtime import flow_options, prepare_environment, settings_cache_key


@task(name="collect-expert", cache_key_fn=settings_cache_key("seed", "sim", "fleet", "demo"), persist_result=True)
def collect_expert_task(settings: Settings) -> step.CollectResult:
    result = step.collect_expert(settings)
    get_run_logger().info("expert demos: %d episodes, %.1f%% success", result.episodes, 100 * result.success_rate)
    return result.reference()  # the folder, not its files: Prefect persists what a cached task returns


@task(name="collect-fleet", cache_key_fn=settings_cache_key("seed", "sim", "fleet"), persist_result=True)
def collect_fleet_task(settings: Settings, round_index: int, champion_version: int, num_robots: int | None) -> step.CollectResult:
    """Deterministic in its inputs (seeded fleet, fixed champion), so a re-run reuses it."""
    result = step.collect_round(settings, round_index, champion_version, num_robots)
    get_run_logger().info(
        "round %d: %d robots ran v%d: %d episodes, %.1f%% success, %d env steps in %.1fs",
        round_index, num_robots or settings.fleet.num_robots, champion_version, result.episodes,
        100 * result.success_rate, result.env_steps, result.seconds,
    )
    return result.reference()


@flow(name="bootstrap")
def bootstrap(settings: Settings | None = None) -> tuple[step.CollectResult, PromotionOutcome]:
    """Scripted-expert demos → the first champion."""
    settings = prepare_environment(settings)
    return loop.bootstrap(settings, fleet_steps(settings))


@flow(name="fleet_round")
def fleet_round(round_index: int | None = None, num_robots: int | None = None, settings: Settings | None = None) -> tuple[step.CollectResult, PromotionOutcome]:
    """One round; ``round_index`` (which seeds the fleet) defaults to the next unused one."""
    settings = prepare_environment(settings)
    return loop.fleet_round(settings, round_index or step.next_round(settings), num_robots, fleet_steps(settings))


def fleet_steps(settings: Settings) -> loop.FleetSteps[PromotionOutcome]:
    """The loop's steps as this flow's tasks and the retrain subflow."""
    return loop.FleetSteps(collect_expert_task, collect_fleet_task, retrain.with_options(**flow_options(settings)))
