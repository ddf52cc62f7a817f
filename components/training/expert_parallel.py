"""Expert-parallel behaviour cloning under torchrun: experts sharded, dense parts data-parallel.

    states/actions .npz -> every rank runs the one trainer's workflow (``training/workflow.py``,
    sequential plan) on the same global batches (``bc.batch_indices``); rank r trains on slice r
    of each batch; MoE layers reach their experts through the shuffle (fused or a baseline, by
    ``shuffle.dispatcher``); dense gradients are all-reduced, expert gradients arrive through the
    shuffle's backward -> rank 0 saves the full state_dict.

The step is the one weighted BC step (``bc.bc_step``): each rank's squared error is divided by
the global element count and the MoE router losses (load balance, z-loss) are split into additive
shares over the global batch, whose routing counts every rank sees (``MoEFeedForward._losses``;
capacity drops are decided on them too), so summing gradients over ranks gives the gradient of
the global loss, and one process with every expert local trains the same model.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from components.config import REPO_ROOT, PolicyConfig, ShuffleConfig, TrainConfig
from components.policy.factory import make_policy
from components.policy.history import gather_windows
from components.policy.moe import StepUsage, enable_expert_parallel, expert_parameter_names, moe_layers
from components.training.bc import batch_indices, bc_step, make_optimizer, total_steps
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
    expert_share: list[list[float]] = field(default_factory=list)  # per step: each expert's share of the pairs
    dropped_rate: list[float] = field(default_factory=list)  # per step: pairs over capacity / pairs routed

    @property
    def expert_usage(self) -> list[StepUsage]:
        return [StepUsage(tuple(s), d) for s, d in zip(self.expert_share, self.dropped_rate, strict=True)]

    @property
    def median_step_s(self) -> float:
        return float(np.median(self.step_times_s)) if self.step_times_s else float("nan")


@dataclass(frozen=True)
class _Data:
    states: torch.Tensor
    actions: torch.Tensor
    weights: torch.Tensor | None
    frame_in_episode: torch.Tensor | None = None  # (N,) where each frame's episode starts (history policies)


def load_npz(path: Path) -> _Data:
    """``states`` (N, n) and ``actions`` (N, m) float32, optional ``weights`` (N,) sampling weights and
    ``frame_in_episode`` (N,) each frame's index in its episode (a history policy's windows)."""
    with np.load(path) as f:
        missing = {"states", "actions"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)}; save states (N, n) and actions (N, m)")
        states, actions = f["states"].astype(np.float32), f["actions"].astype(np.float32)
        weights = f["weights"].astype(np.float64) if "weights" in f.files else None
        positions = f["frame_in_episode"].astype(np.int64) if "frame_in_episode" in f.files else None
    if states.ndim != 2 or actions.ndim != 2 or len(states) != len(actions) or len(states) == 0:
        raise ValueError(f"{path}: states {states.shape} / actions {actions.shape} must be (N, n) / (N, m), N > 0")
    if weights is not None and (weights.shape != (len(states),) or (weights < 0).any() or weights.sum() <= 0):
        raise ValueError(f"{path}: weights must be (N,) non-negative with a positive sum")
    if positions is not None and (positions.shape != (len(states),) or (positions < 0).any()):
        raise ValueError(f"{path}: frame_in_episode must be (N,) non-negative frame indices")
    return _Data(torch.from_numpy(states), torch.from_numpy(actions),
                 None if weights is None else torch.from_numpy(weights),
                 None if positions is None else torch.from_numpy(positions))


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
        self.data = _Data(data.states.to(self.device), data.actions.to(self.device), data.weights,
                          data.frame_in_episode)
        self.history = policy_cfg.frames()
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.batch = train_cfg.batch_size
        if self.batch % self.world:
            raise ValueError(f"train.batch_size={self.batch} must be a multiple of the {self.world} ranks")
        seed_everything(seed)
        self.seed, self.steps = seed, 0
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
        self.optimizer = make_optimizer(self.model, train_cfg.lr, train_cfg.weight_decay)
        self.model.train()
        self.local = slice(self.rank * self.batch // self.world, (self.rank + 1) * self.batch // self.world)

    def step(self) -> tuple[float, float]:
        """One step on this rank's slice of the next global batch -> (global loss, seconds)."""
        idx = batch_indices(len(self.data.states), self.data.weights, self.batch, 1, self.seed, self.steps)[0]
        idx = idx[self.local]
        inputs = gather_windows(self.data.states, self.data.frame_in_episode, idx.to(self.device), self.history)
        idx = idx.to(self.device)
        self.steps += 1
        start = time.perf_counter()
        loss = bc_step(self.model, self.optimizer, inputs, self.targets[idx], self.batch, self.group,
                       self.dense)  # float(): a host sync, so on CUDA the step time covers the kernels
        return loss, time.perf_counter() - start

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
    """One rank's run of the one trainer (``group=None``: a single process, experts local; ``device``:
    CPU by default; ``init_path``: a full state_dict to fine-tune, e.g. the champion's)."""
    from components.config import SchedulerConfig
    from components.training.imitation import TrainingSet
    from components.training.trainer import Trainer
    from components.training.workflow import TrainSpec

    world = 1 if group is None else dist.get_world_size(group)
    raw = load_npz(data_path)
    torch.set_num_threads(max(1, train_cfg.threads) if world > 1 else (train_cfg.threads or torch.get_num_threads()))
    data = TrainingSet(raw.states.numpy(), raw.actions.numpy(), None if raw.weights is None else raw.weights.numpy(),
                       None if raw.frame_in_episode is None else raw.frame_in_episode.numpy())
    total = total_steps(len(data.states), train_cfg.batch_size, train_cfg.epochs)
    spec = TrainSpec(
        data=data, policy=policy_cfg, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
        batch_size=train_cfg.batch_size, seed=seed, total_steps=min(total, max_steps) if max_steps else total,
        steps_per_iteration=train_cfg.steps_per_iteration,
        init_state=None if init_path is None else torch.load(init_path, weights_only=True),
        learner_threads=max(1, train_cfg.threads), expert_parallel=shuffle_cfg if group is not None else None,
        device=str(device or "cpu"),
    )
    trainer = Trainer(spec, SchedulerConfig(plan="sequential"))  # collectives: every rank runs ops in one order
    run = trainer.run()
    per_step = [s / spec.steps_in(i) for i, s in enumerate(run.iteration_s) for _ in range(spec.steps_in(i))]
    if (0 if group is None else dist.get_rank(group)) == 0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in run.policy.state_dict().items()}, out_path)
    return ExpertParallelResult(out_path, run.losses, per_step, world, shuffle_cfg.dispatcher if world > 1 else "local",
                                run.shuffle_bytes_sent, [list(u.share) for u in run.expert_usage],
                                [u.dropped_rate for u in run.expert_usage])


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
