"""`fleet_round`: the fleet runs ``@champion`` for a fixed time per robot, then `retrain` on what it did."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from components.config import Settings
from components.pipeline import steps
from components.pipeline.workspace import Workspace
from flows.retrain import retrain


@task(name="collect-expert", cache_policy=NO_CACHE)
def collect_expert_task(settings: Settings) -> steps.CollectResult:
    result = steps.collect_expert_demos(settings, settings.paths.incoming / "expert")
    get_run_logger().info("expert demos: %d episodes, %.1f%% success", result.episodes, 100 * result.success_rate)
    return result


@task(name="collect-fleet", cache_policy=NO_CACHE, retries=1)
def collect_fleet_task(settings: Settings, round_index: int, num_robots: int | None) -> steps.CollectResult:
    ws = Workspace(settings)
    champion = ws.registry.champion()
    if champion is None:
        raise RuntimeError("no champion to run on the fleet; bootstrap first with `fleetloop retrain --bootstrap`")
    policy = ws.registry.load(champion.version)
    out = settings.paths.incoming / f"round-{round_index:03d}"
    result = steps.collect_fleet(settings, policy, f"v{champion.version}", out, round_index, num_robots)
    get_run_logger().info(
        "round %d: %d robots ran v%d, %d episodes, %.1f%% success, %d env steps in %.1fs",
        round_index, num_robots or settings.fleet.num_robots, champion.version, result.episodes,
        100 * result.success_rate, result.env_steps, result.seconds,
    )
    return result


@flow(name="bootstrap")
def bootstrap(settings: Settings) -> tuple[steps.CollectResult, steps.PromotionOutcome]:
    """Scripted-expert demos → the first champion."""
    demos = collect_expert_task(settings)
    return demos, retrain(settings, demos.files, run_name="bootstrap")


@flow(name="fleet_round")
def fleet_round(settings: Settings, round_index: int, num_robots: int | None = None) -> tuple[steps.CollectResult, steps.PromotionOutcome]:
    collected = collect_fleet_task(settings, round_index, num_robots)
    return collected, retrain(settings, collected.files, run_name=f"round-{round_index}")
