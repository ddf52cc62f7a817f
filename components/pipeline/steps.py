"""Train step: pick the frames to imitate for ``train.method`` (one FERT, components/fert) and
train or fine-tune a policy with the one trainer (components/training/trainer.py) through the
embedded scheduler.

The other steps live beside this file (collect, ingest, evaluate, promote); what a training
builds and returns is in ``outcome.py``, below this module and the expert-parallel path
(``distributed.py``). Prefect flows wrap each step in a task (retries, caching, artifacts);
``fleetloop stage train`` (``dvc repro``), the FATS fleet trainer and the benchmarks call these
same functions, so every path builds the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from components.config import Settings
from components.pipeline.distributed import train_expert_parallel
from components.pipeline.outcome import (  # noqa: F401 - the train step's public names, re-exported
    RETRIEVAL_METHODS,
    TRAIN_TASK_RECIPE,
    TrainingSummary,
    TrainOutcome,
    current_lineage,
    method_training_set,
    retrieval_record,
    summarize,
    training_set,
    with_usage_plot,
)
from components.pipeline.workspace import Workspace
from components.policy.normalizer import NormalizedPolicy
from components.training.imitation import ProgressFn, TrainResult
from components.training.trainer import make_trainer


# -- train -----------------------------------------------------------------------------------
def starting_policy(settings: Settings, ws: Workspace) -> NormalizedPolicy | None:
    """The champion to fine-tune, when there is one of this policy's architecture."""
    if ws.registry.champion() is None:
        return None
    return fine_tunable(settings, ws, ws.registry.load("champion"))


def fine_tunable(settings: Settings, ws: Workspace, champion: NormalizedPolicy) -> NormalizedPolicy | None:
    """``champion`` when ``settings.policy`` has its architecture (it is then fine-tuned), else None."""
    from components.policy.factory import make_policy
    from components.policy.observation import configured_layout

    layout = configured_layout(ws.obs_dim, settings.policy, settings.sim)
    expected = make_policy(ws.obs_dim, ws.act_dim, settings.policy, layout).state_dict()
    state = champion.state_dict()
    if state.keys() != expected.keys() or any(state[k].shape != expected[k].shape for k in expected):
        return None  # another architecture (e.g. an MLP champion, an MoE policy): train from scratch
    return champion


def train_policy(settings: Settings, progress: ProgressFn | None = None,
                 log: Callable[[str], None] | None = None) -> TrainOutcome:
    """Train on ``training_set`` through the one trainer; fine-tunes the champion when there is one."""
    if settings.train.world_size > 1:
        return train_expert_parallel(settings)
    ws = Workspace(settings)
    champion = ws.registry.champion()
    built = training_set(settings, ws)
    trainer = make_trainer(settings, built.data, starting_policy(settings, ws), log)
    run = trainer.run(on_iteration=_progress_callback(progress, trainer.spec))
    result = TrainResult(policy=run.policy, losses=run.losses, steps=len(run.losses), seconds=run.seconds, device="cpu")
    frames = len(built.data.states)
    summary = summarize(built, run, settings.paths.artifacts / "schedules")
    lineage = current_lineage(settings, ws, frames, champion.version if champion else None, TRAIN_TASK_RECIPE)
    return TrainOutcome(result, lineage, frames, summary, retrieval_record(settings, built))


def in_caller_context(progress: ProgressFn) -> ProgressFn:
    """``progress``, callable from the executor's worker threads but run in the caller's context
    (Prefect's run context lives in context variables, which new threads do not inherit)."""
    import contextvars

    ctx = contextvars.copy_context()
    return lambda step, total, loss: ctx.run(progress, step, total, loss)  # the executor serializes calls


def _progress_callback(progress: ProgressFn | None, spec: Any) -> Callable[[int, dict[str, Any]], None] | None:
    """Per-iteration executor callback -> ``progress(steps done, total steps, last loss)``."""
    if progress is None:
        return None
    report = in_caller_context(progress)
    done = [0]

    def on_iteration(i: int, recorded: dict[str, Any]) -> None:
        losses = recorded.get("stats", {}).get("losses", [float("nan")])
        done[0] += len(losses)
        report(done[0], spec.total_steps, float(losses[-1]))

    return on_iteration
