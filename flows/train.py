"""`train`: imitation on the stored dataset (method from params), cached on data snapshot + params."""

from __future__ import annotations

from prefect import flow, get_run_logger, task

from components.config import Settings
from components.episodes.snapshot import read_snapshot
from components.pipeline import steps
from flows.artifacts import ProgressArtifact
from components.pipeline.workspace import Workspace
from flows.runtime import prepare_environment, settings_cache_key


TRAIN_INPUTS = ("seed", "device", "sim", "store", "policy", "train", "fert")


def conditional_inputs(settings: Settings) -> tuple[str, ...]:
    """Sections only some trainings read: the scheduler's (workloads run through it) and the MoE
    shuffle's (expert-parallel training). Others never re-train a cached model when they change."""
    return (("scheduler",) if settings.train.workload != "imitation" else ()) + (
        ("shuffle",) if settings.train.world_size > 1 else ())


@task(name="train-policy", cache_key_fn=settings_cache_key(*TRAIN_INPUTS, depends=conditional_inputs), persist_result=True)
def train_task(settings: Settings, snapshot_hash: str, champion_version: int | None) -> steps.TrainOutcome:
    """Same data (``snapshot_hash``) + same params + same starting point = the same model
    (CPU determinism), so a re-run takes the cached one."""
    what = settings.train.method if settings.train.workload == "imitation" else settings.train.workload
    progress = ProgressArtifact("train-progress", f"training {what}")
    logger = get_run_logger()

    def report(step: int, total: int, loss: float) -> None:
        progress.update(step, total)
        if step == total or step % max(1, total // 10) < settings.train.log_every:
            logger.info("step %d/%d loss %.4f", step, total, loss)

    if settings.train.world_size > 1:
        from components.pipeline.distributed import train_expert_parallel

        logger.info("expert-parallel training on %d torchrun processes", settings.train.world_size)
        return train_expert_parallel(settings)
    if settings.train.workload != "imitation":
        from components.pipeline.scheduled import train_scheduled

        logger.info("%s through the embedded scheduler (plan %s, %d iterations)", settings.train.workload,
                    settings.scheduler.plan, settings.scheduler.iterations)
        outcome = train_scheduled(settings, report)
        if outcome.schedule is not None:
            logger.info("%s\niteration seconds: %s", outcome.schedule.plan_text,
                        ", ".join(f"{x:.3f}" for x in outcome.schedule.iteration_s))
        return outcome
    return steps.train_policy(settings, report)


@flow(name="train")
def train(settings: Settings | None = None) -> steps.TrainOutcome:
    settings = prepare_environment(settings)
    snapshot = read_snapshot(settings.paths.episodes)
    champion = Workspace(settings).registry.champion()
    outcome = train_task(settings, snapshot.hash if snapshot else "none", champion.version if champion else None)
    get_run_logger().info(
        "trained %s on %d frames in %.1fs (final loss %.4f)",
        settings.train.method, outcome.frames, outcome.result.seconds, outcome.result.final_loss,
    )
    return outcome
