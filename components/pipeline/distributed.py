"""Expert-parallel training for ``train.world_size > 1``: the same training set, trained by
``torchrun`` processes (gloo on CPU, NCCL with CUDA) through the MoE token shuffle.

The result is the same value object the single-process path returns, so evaluation, lineage and
promotion do not care which path trained the model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from components.config import Settings
from components.pipeline.steps import TrainOutcome, current_lineage, training_set
from components.pipeline.workspace import Workspace
from components.policy.factory import make_policy
from components.training.expert_parallel import launch_expert_parallel
from components.training.imitation import TrainResult


def train_expert_parallel(settings: Settings) -> TrainOutcome:
    if settings.policy.kind != "moe_transformer":
        raise ValueError(
            f"train.world_size={settings.train.world_size} trains expert-parallel, which needs an MoE policy; "
            "set policy.kind: moe_transformer in params.yaml (or train.world_size: 1)"
        )
    ws = Workspace(settings)
    data = training_set(settings, ws)
    settings.paths.artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.paths.artifacts) as tmp:
        data_path = Path(tmp) / "training_set.npz"
        arrays = {"states": data.states, "actions": data.actions}
        if data.weights is not None:
            arrays["weights"] = data.weights.astype(np.float64)
        np.savez(data_path, **arrays)
        run = launch_expert_parallel(
            data_path, Path(tmp) / "policy.pt", settings.policy, settings.train, settings.shuffle, seed=settings.seed,
            nproc=settings.train.world_size,
        )
        policy = make_policy(ws.obs_dim, ws.act_dim, settings.policy)
        policy.load_state_dict(torch.load(run.state_dict_path, weights_only=True))
    policy.eval()
    result = TrainResult(policy=policy, losses=run.losses, steps=len(run.losses), seconds=float(sum(run.step_times_s)), device="cpu")
    return TrainOutcome(result, current_lineage(settings, ws, len(data.states)), len(data.states))
