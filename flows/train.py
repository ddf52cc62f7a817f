"""`train`: the one trainer on the stored dataset (``train.method``, FERT by default) through the
embedded scheduler; cached on data snapshot + params + starting point. It returns a reference to
the staged candidate (``CandidateRef``), never the model: Prefect records and caches what a task
and a flow return."""

from __future__ import annotations

from prefect import flow, get_run_logger, task

from components.config import Settings
from components.episodes.snapshot import read_snapshot
from components.pipeline import steps
from components.pipeline.references import CandidateRef, stage_candidate
from components.pipeline.workspace import Workspace
from flows import artifacts
from flows.artifacts import ProgressArtifact
from flows.ingest import sync_task
from flows.runtime import io_options, prepare_environment, settings_cache_key

TRAIN_INPUTS = ("seed", "device", "sim", "store", "policy", "train", "fert")


def conditional_inputs(settings: Settings) -> tuple[str, ...]:
    """Sections only some trainings read: PPO's sizes live in the scheduler section, and the MoE
    shuffle's in the shuffle section (expert-parallel training). The plan never changes the
    weights of the imitation workflow, so scheduler knobs never re-train a cached model."""
    return (("scheduler",) if settings.train.workload == "ppo" else ()) + (
        ("shuffle",) if settings.train.world_size > 1 else ())


@task(name="train-policy", cache_key_fn=settings_cache_key(*TRAIN_INPUTS, depends=conditional_inputs), persist_result=True)
def train_task(settings: Settings, snapshot_hash: str, champion_version: int | None) -> CandidateRef:
    """Same data (``snapshot_hash``) + same params + same starting point = the same model
    (CPU determinism), so a re-run takes the cached reference (``train`` retrains if its staged
    file is gone)."""
    what = settings.train.method if settings.train.workload == "imitation" else settings.train.workload
    progress = ProgressArtifact("train-progress", f"training {what}")
    logger = get_run_logger()

    def report(step: int, total: int, loss: float) -> None:
        progress.update(step, total)
        if step == total or step % max(1, total // 10) < settings.train.steps_per_iteration:
            logger.info("step %d/%d loss %.4f", step, total, loss)

    if settings.train.workload == "ppo":
        from components.pipeline.scheduled import train_scheduled

        logger.info("PPO through the embedded scheduler (plan %s, %d iterations)", settings.scheduler.plan,
                    settings.scheduler.iterations)
        return stage_candidate(settings, train_scheduled(settings, report))
    if settings.train.world_size > 1:
        logger.info("expert-parallel training on %d torchrun processes over %d host(s)", settings.train.world_size,
                    settings.distributed.nnodes)
    outcome = steps.train_policy(settings, report, logger.info)
    if outcome.summary is not None:
        summary = outcome.summary
        logger.info("%s\nmedian iteration %.1f ms (sequential %s); stage seconds: %s", summary.plan_text,
                    1e3 * summary.median_iteration_s,
                    "n/a" if summary.sequential_iteration_s is None else f"{1e3 * summary.sequential_iteration_s:.1f} ms",
                    ", ".join(f"{k} {v:.2f}" for k, v in summary.stage_seconds.items()))
        artifacts.training_summary(summary)
    return stage_candidate(settings, outcome)


@flow(name="train")
def train(settings: Settings | None = None) -> CandidateRef:
    settings = prepare_environment(settings)
    sync_task.with_options(**io_options(settings))(settings)  # with a DVC remote: train on its head
    snapshot = read_snapshot(settings.paths.episodes)
    champion = Workspace(settings).registry.champion()
    inputs = (settings, snapshot.hash if snapshot else "none", champion.version if champion else None)
    candidate = train_task(*inputs)
    if not candidate.exists():  # a cached reference whose staged file was removed: train it again
        get_run_logger().warning("staged candidate %s is gone: training again", candidate.path)
        candidate = train_task.with_options(refresh_cache=True)(*inputs)
    get_run_logger().info("trained %s on %d frames in %.1fs (final loss %.4f): %s", candidate.method, candidate.frames,
                          candidate.seconds, candidate.final_loss, candidate.path)
    return candidate
