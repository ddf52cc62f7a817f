"""Expert-parallel behaviour cloning under torchrun: experts sharded, dense parts data-parallel.

    states/actions .npz -> every rank builds the same model (seed) and draws the same global
    batches; rank r trains on slice r of each batch; MoE layers reach their experts through the
    shuffle (fused or a baseline, by ``shuffle.dispatcher``); dense gradients are all-reduced,
    expert gradients arrive through the shuffle's backward -> rank 0 saves the full state_dict.

Loss scaling makes the distributed step the single-process step: each rank's MSE is summed
over its slice and divided by the global batch size, and the MoE balance loss is split into
additive shares (``MoEFeedForward._balance_loss``), so summing gradients over ranks gives the
gradient of the global loss. Batch sampling copies ``training.imitation`` (with replacement,
by ``weights`` when given), so one rank reproduces that loop's batches.

Run: ``launch_expert_parallel(...)`` (spawns ``torchrun --standalone --nproc-per-node=N``), or
``torchrun --standalone --nproc-per-node=4 -m components.training.expert_parallel --data d.npz
--out model.pt --config cfg.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from components.config import REPO_ROOT, PolicyConfig, ShuffleConfig, TrainConfig
from components.policy.factory import make_policy
from components.policy.moe import enable_expert_parallel, expert_parameter_names, full_expert_state, moe_layers
from components.training.determinism import seed_everything

RESULT_SUFFIX = ".result.json"
NCCL_UNSUPPORTED_PLANS = ("one_level", "two_level")  # plan.py builds their descriptors on the CPU
CONFIG_SUFFIX = ".config.json"
STDERR_TAIL = 4000


@dataclass(frozen=True)
class ExpertParallelResult:
    state_dict_path: Path
    losses: list[float]  # global loss per step
    step_times_s: list[float]  # rank 0 wall time per step (forward, backward, all-reduce, update)
    world_size: int
    dispatcher: str
    shuffle_bytes_sent: int  # rank 0, row payload to other ranks, whole run

    @property
    def median_step_s(self) -> float:
        return float(np.median(self.step_times_s)) if self.step_times_s else float("nan")


@dataclass(frozen=True)
class _Data:
    states: torch.Tensor
    actions: torch.Tensor
    weights: torch.Tensor | None


def load_npz(path: Path) -> _Data:
    """``states`` (N, n) and ``actions`` (N, m) float32, optional ``weights`` (N,) sampling weights."""
    with np.load(path) as f:
        missing = {"states", "actions"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)}; save states (N, n) and actions (N, m)")
        states, actions = f["states"].astype(np.float32), f["actions"].astype(np.float32)
        weights = f["weights"].astype(np.float64) if "weights" in f.files else None
    if states.ndim != 2 or actions.ndim != 2 or len(states) != len(actions) or len(states) == 0:
        raise ValueError(f"{path}: states {states.shape} / actions {actions.shape} must be (N, n) / (N, m), N > 0")
    if weights is not None and (weights.shape != (len(states),) or (weights < 0).any() or weights.sum() <= 0):
        raise ValueError(f"{path}: weights must be (N,) non-negative with a positive sum")
    return _Data(torch.from_numpy(states), torch.from_numpy(actions),
                 None if weights is None else torch.from_numpy(weights))


class ExpertParallelTrainer:
    """One rank's model, optimizer and batch stream; ``step()`` runs one training step.

    Two trainers can share a process group and alternate steps (the benchmark times the fused
    and baseline shuffles side by side that way); ``train_expert_parallel`` drives one.
    """

    def __init__(self, data: _Data, policy_cfg: PolicyConfig, train_cfg: TrainConfig, shuffle_cfg: ShuffleConfig,
                 seed: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 init_state: dict[str, torch.Tensor] | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.group, self.shuffle_cfg = group, shuffle_cfg
        self.data = _Data(data.states.to(self.device), data.actions.to(self.device), data.weights)
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.batch = train_cfg.batch_size
        if self.batch % self.world:
            raise ValueError(f"train.batch_size={self.batch} must be a multiple of the {self.world} ranks")
        self.generator = seed_everything(seed)
        self.model = make_policy(data.states.shape[1], data.actions.shape[1], policy_cfg)
        if init_state is None:
            self.model.obs_norm.fit(data.states)
            self.model.act_norm.fit(data.actions)
        else:  # fine-tune (the champion): its full state, normalizers included, before experts are sharded
            self.model.load_state_dict(init_state)
        self.model.to(self.device)
        self.targets = self.model.act_norm.normalize(self.data.actions)
        if group is not None:
            enable_expert_parallel(self.model, group, shuffle_cfg)
        experts = expert_parameter_names(self.model)
        self.dense = [p for name, p in self.model.named_parameters() if name not in experts]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train_cfg.lr,
                                           weight_decay=train_cfg.weight_decay)
        self.model.train()
        self.local = slice(self.rank * self.batch // self.world, (self.rank + 1) * self.batch // self.world)

    def step(self) -> tuple[float, float]:
        """One step on this rank's slice of the next global batch -> (global loss, seconds)."""
        n = len(self.data.states)
        if self.data.weights is None:
            idx = torch.randint(n, (self.batch,), generator=self.generator)
        else:
            idx = torch.multinomial(self.data.weights, self.batch, replacement=True, generator=self.generator)
        idx = idx[self.local].to(self.device)
        start = time.perf_counter()
        pred = self.model.forward_normalized(self.data.states[idx])
        mse = nn.functional.mse_loss(pred, self.targets[idx], reduction="sum") / (self.batch * pred.shape[1])
        loss = mse + self.model.aux_loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        total_loss = loss.detach().clone()
        if self.group is not None:
            _all_reduce_grads(self.dense, self.group)
            dist.all_reduce(total_loss, group=self.group)
        self.optimizer.step()
        loss_value = float(total_loss)  # a host sync: on CUDA the step time then covers the kernels
        return loss_value, time.perf_counter() - start

    def shuffle_bytes_sent(self) -> int:
        return sum(layer.dispatcher.transport.meter.bytes_sent for layer in moe_layers(self.model) if layer.dispatcher)


def train_expert_parallel(
    data_path: Path,
    out_path: Path,
    policy_cfg: PolicyConfig,
    train_cfg: TrainConfig,
    shuffle_cfg: ShuffleConfig,
    seed: int,
    max_steps: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    init_path: Path | None = None,
) -> ExpertParallelResult:
    """One rank's training loop (``group=None``: a single process, experts local; ``device``: CPU by default;
    ``init_path``: a full state_dict to fine-tune, e.g. the champion's)."""
    world = 1 if group is None else dist.get_world_size(group)
    data = load_npz(data_path)
    torch.set_num_threads(max(1, train_cfg.threads) if world > 1 else (train_cfg.threads or torch.get_num_threads()))
    init_state = None if init_path is None else torch.load(init_path, weights_only=True)
    trainer = ExpertParallelTrainer(data, policy_cfg, train_cfg, shuffle_cfg, seed, group, device, init_state)
    total = max(1, len(data.states) // train_cfg.batch_size) * train_cfg.epochs
    total = min(total, max_steps) if max_steps else total
    losses, times = [], []
    for _ in range(total):
        loss, seconds = trainer.step()
        losses.append(loss)
        times.append(seconds)
    state = {k: v.cpu() for k, v in full_expert_state(trainer.model, group).items()}
    if trainer.rank == 0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out_path)
    return ExpertParallelResult(out_path, losses, times, world, shuffle_cfg.dispatcher if world > 1 else "local",
                                trainer.shuffle_bytes_sent())


def _all_reduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum dense gradients over ranks in one flat buffer (each rank's loss is its share of the global one)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


# --------------------------------------------------------------------------------------------
# launcher and torchrun entry


def launch_expert_parallel(
    data_path: Path,
    out_path: Path,
    policy_cfg: PolicyConfig,
    train_cfg: TrainConfig,
    shuffle_cfg: ShuffleConfig,
    seed: int,
    nproc: int | None = None,
    max_steps: int | None = None,
    timeout_s: float | None = None,
    init_path: Path | None = None,
) -> ExpertParallelResult:
    """Run ``torchrun --standalone --nproc-per-node=N`` on this module (gloo on CPU, NCCL with CUDA:
    ``shuffle.backend: auto``; the NCCL path is written device-agnostic but untested here)."""
    nproc = nproc or train_cfg.world_size
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    config_path = out_path.with_suffix(CONFIG_SUFFIX)
    config_path.write_text(json.dumps({
        "policy": policy_cfg.model_dump(mode="json"),
        "train": train_cfg.model_dump(mode="json"),
        "shuffle": shuffle_cfg.model_dump(mode="json"),
    }))
    result_path = out_path.with_suffix(RESULT_SUFFIX)
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "components.training.expert_parallel", "--data", str(data_path), "--out", str(out_path),
           "--config", str(config_path), "--seed", str(seed)]
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    if init_path is not None:
        cmd += ["--init", str(init_path)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(
            f"expert-parallel training failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stderr[-STDERR_TAIL:]}"
        )
    raw = json.loads(result_path.read_text())
    raw["state_dict_path"] = Path(raw["state_dict_path"])
    return ExpertParallelResult(**raw)


def _backend(cfg: ShuffleConfig) -> str:
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return cfg.backend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="expert-parallel BC training (run under torchrun)")
    parser.add_argument("--data", type=Path, required=True, help=".npz with states, actions[, weights]")
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 saves the full state_dict")
    parser.add_argument("--config", type=Path, required=True, help="JSON with policy, train, shuffle sections")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--init", type=Path, default=None, help="full state_dict to fine-tune (the champion's)")
    args = parser.parse_args(argv)
    cfg = json.loads(args.config.read_text())
    policy_cfg, train_cfg = PolicyConfig(**cfg["policy"]), TrainConfig(**cfg["train"])
    shuffle_cfg = ShuffleConfig(**cfg["shuffle"])
    backend = _backend(shuffle_cfg)
    device = None
    if backend == "nccl":  # one GPU per rank; the shuffle's index tensors follow the tokens onto it
        if shuffle_cfg.dispatcher == "dedup_permute" or shuffle_cfg.plan in NCCL_UNSUPPORTED_PLANS:
            raise ValueError(f"shuffle.plan={shuffle_cfg.plan} / dispatcher={shuffle_cfg.dispatcher} build CPU index "
                             "plans (gloo only); on NCCL use shuffle.plan: auto or rank_dedup (or dispatcher: megatron)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        result = train_expert_parallel(args.data, args.out, policy_cfg, train_cfg, shuffle_cfg, args.seed,
                                       args.max_steps, dist.group.WORLD, device, args.init)
        if dist.get_rank() == 0:
            raw = asdict(result)
            raw["state_dict_path"] = str(result.state_dict_path)
            args.out.with_suffix(RESULT_SUFFIX).write_text(json.dumps(raw))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
