"""Expert-parallel training for ``train.world_size > 1``: the same training set, trained by
``torchrun`` processes (gloo on CPU, NCCL with CUDA) through the MoE token shuffle.

The result is the same value object the single-process path returns, so evaluation, lineage and
promotion do not care which path trained the model. With ``distributed.nnodes`` > 1 this host is
node 0: it builds the training set, its torchrun meets the other hosts at the c10d rendezvous and
sends them the data; each other host runs ``join_training`` (``fleetloop train-node``), which needs
no dataset, store or registry, only the same params. Like the single-process path it fine-tunes
the champion when there is one of the same architecture (an MLP champion cannot seed an MoE
policy: then it trains from scratch and says so in the log).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import torch

from components.config import Settings
from components.pipeline.outcome import (
    TrainingSummary,
    TrainOutcome,
    current_lineage,
    retrieval_record,
    training_set,
    with_usage_plot,
)
from components.pipeline.workspace import Workspace
from components.policy.factory import make_policy
from components.training.expert_parallel import ExpertParallelResult, launch_expert_parallel
from components.training.checkpoint import state_digest
from components.training.imitation import TrainResult

log = logging.getLogger(__name__)


def champion_init_state(ws: Workspace, settings: Settings) -> dict[str, torch.Tensor] | None:
    """The champion's full state_dict when it has this policy's architecture, else None."""
    if ws.registry.champion() is None:
        return None
    state = ws.registry.load("champion").state_dict()
    expected = make_policy(ws.obs_dim, ws.act_dim, settings.policy).state_dict()
    if state.keys() != expected.keys() or any(state[k].shape != expected[k].shape for k in expected):
        log.warning("the champion's architecture differs from policy.%s: expert-parallel training starts from scratch",
                    settings.policy.kind)
        return None
    return state


def _check_expert_parallel(settings: Settings) -> None:
    if settings.policy.kind != "moe_transformer":
        raise ValueError(
            f"train.world_size={settings.train.world_size} trains expert-parallel, which needs an MoE policy; "
            "set policy.kind: moe_transformer in params.yaml (or train.world_size: 1)"
        )


def train_expert_parallel(settings: Settings) -> TrainOutcome:
    _check_expert_parallel(settings)
    if settings.distributed.node_rank != 0:
        raise ValueError(
            f"distributed.node_rank={settings.distributed.node_rank}: only node 0 builds the training set and "
            "trains; on this host run `fleetloop train-node` (it joins node 0's run), or set distributed.node_rank: 0"
        )
    ws = Workspace(settings)
    built = training_set(settings, ws)
    data = built.data
    settings.paths.artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.paths.artifacts) as tmp:
        data_path = Path(tmp) / "training_set.npz"
        arrays = {"states": data.states, "actions": data.actions}
        if data.weights is not None:
            arrays["weights"] = data.weights.astype(np.float64)
        if data.frame_in_episode is not None:
            arrays["frame_in_episode"] = data.frame_in_episode.astype(np.int64)
        np.savez(data_path, **arrays)
        init_path = None
        init_state = champion_init_state(ws, settings)
        if init_state is not None:
            init_path = Path(tmp) / "champion.pt"
            torch.save(init_state, init_path)
        run = launch_expert_parallel(
            data_path, Path(tmp) / "policy.pt", settings.policy, settings.train, settings.shuffle, seed=settings.seed,
            init_path=init_path, distributed=settings.distributed,
        )
        policy = make_policy(ws.obs_dim, ws.act_dim, settings.policy)
        policy.load_state_dict(torch.load(run.state_dict_path, weights_only=True))
    policy.eval()
    seconds = float(sum(run.step_times_s))
    result = TrainResult(policy=policy, losses=run.losses, steps=len(run.losses), seconds=seconds, device="cpu")
    median = float(np.median(run.step_times_s)) * settings.train.steps_per_iteration if run.step_times_s else 0.0
    summary = TrainingSummary(
        method=built.report.method, fert=built.report.to_dict(),
        plan_name=f"sequential x {run.world_size} torchrun ranks" + (
            f" on {settings.distributed.nnodes} hosts" if settings.distributed.nnodes > 1 else ""),
        plan_text=f"every rank runs the training workflow's sequential plan ({run.dispatcher} shuffle)",
        plan_requested=settings.scheduler.plan, plan_source="fixed", iterations=-(-len(run.losses) // settings.train.steps_per_iteration),
        iteration_s=[], median_iteration_s=median, predicted_iteration_s=None, sequential_iteration_s=None,
        speedup_vs_sequential=None, stage_seconds={"learn": seconds}, validation=[],
    )
    summary = with_usage_plot(summary, run.expert_usage, settings.paths.artifacts / "schedules",
                              state_digest(policy.state_dict()))
    return TrainOutcome(result, current_lineage(settings, ws, len(data.states)), len(data.states), summary,
                        retrieval_record(settings, built))


def join_training(settings: Settings) -> ExpertParallelResult:
    """This host's ranks of node 0's run (``distributed.node_rank`` > 0): they receive node 0's
    training set and starting weights over the process group and train their experts; node 0 keeps
    the model, this host keeps nothing (the run's figures only). Returns when the run ends."""
    _check_expert_parallel(settings)
    distributed = settings.distributed
    if distributed.nnodes < 2 or distributed.node_rank == 0:
        raise ValueError(
            f"distributed.nnodes={distributed.nnodes}, node_rank={distributed.node_rank}: a joining host is node 1 or "
            "above of a run on 2 or more hosts; set distributed.nnodes (the same on every host) and pass --node-rank N"
        )
    settings.paths.artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.paths.artifacts) as tmp:
        return launch_expert_parallel(None, Path(tmp) / "policy.pt", settings.policy, settings.train, settings.shuffle,
                                      seed=settings.seed, distributed=distributed)
