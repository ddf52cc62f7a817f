"""Expert-parallel behaviour cloning under torchrun: experts sharded, dense parts data-parallel.

    states/actions .npz -> every rank runs the one trainer's workflow (``training/workflow.py``,
    sequential plan) on the same global batches (``bc.batch_indices``); rank r trains on slice r
    of each batch; MoE layers reach their experts through the shuffle (fused or a baseline, by
    ``shuffle.dispatcher``); dense gradients are all-reduced, expert gradients arrive through the
    shuffle's backward -> node 0's first rank (rank 0 on one host) saves the full state_dict.

The step is the one weighted BC step (``bc.bc_step``): each rank's squared error is divided by
the global element count and the MoE router losses (load balance, z-loss) are split into additive
shares over the global batch, whose routing counts every rank sees (``MoEFeedForward._losses``;
capacity drops are decided on them too), so summing gradients over ranks gives the gradient of
the global loss, and one process with every expert local trains the same model.

Run: ``launch_expert_parallel(...)`` (spawns ``torchrun --standalone --nproc-per-node=N``; with
``distributed.nnodes`` > 1 one launcher per host meets the others at torchrun's c10d rendezvous and
node 0's first rank sends the training set: ``multinode.py``), or ``torchrun --standalone
--nproc-per-node=4 -m components.training.expert_parallel --data d.npz --out model.pt --config cfg.json``.
"""

from __future__ import annotations

import argparse
import io
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

from components.config import REPO_ROOT, DistributedConfig, PolicyConfig, ShuffleConfig, TrainConfig
from components.policy.factory import make_policy
from components.policy.history import as_tensor_episode_ends, gather_chunks, gather_windows
from components.policy.moe import StepUsage, enable_expert_parallel, expert_parameter_names, moe_layers
from components.training.bc import batch_indices, bc_step, make_optimizer, total_steps
from components.training.determinism import seed_everything
from components.training.multinode import (
    ERROR_MARKER,
    NodeMismatchError,
    agree_on_run,
    load_init,
    read_inputs,
    run_spec,
    share_inputs,
    shuffle_for_topology,
    torchrun_args,
)

RESULT_SUFFIX = ".result.json"
NCCL_UNSUPPORTED_PLANS = ("one_level", "two_level")  # plan.py builds their descriptors on the CPU
CONFIG_SUFFIX = ".config.json"
STDERR_TAIL = 4000


class ExpertParallelError(RuntimeError):
    """torchrun failed: the message says why (a worker's own error, the rendezvous) and ends in '. Fix: ...'."""


@dataclass(frozen=True)
class ExpertParallelResult:
    state_dict_path: Path | None  # None on a node other than node 0: the model is kept there
    losses: list[float]  # global loss per step
    step_times_s: list[float]  # the writing rank's wall time per step (forward, backward, all-reduce, update)
    world_size: int
    dispatcher: str
    shuffle_bytes_sent: int  # the writing rank's row payload to other ranks, whole run
    expert_share: list[list[float]] = field(default_factory=list)  # per step: each expert's share of the pairs
    dropped_rate: list[float] = field(default_factory=list)  # per step: pairs over capacity / pairs routed
    node_rank: int = 0  # distributed.node_rank of the node that wrote this result
    data_sha256: str = ""  # of the training set (.npz bytes) every rank trained on: node 0's

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


def load_npz(source: Path | bytes, name: str | None = None) -> _Data:
    """``states`` (N, n) and ``actions`` (N, m) float32, optional ``weights`` (N,) sampling weights and
    ``frame_in_episode`` (N,) each frame's index in its episode (a history policy's windows).
    ``source``: a file, or the bytes node 0 sent (``name`` says whose in an error)."""
    path = name or source
    with np.load(io.BytesIO(source) if isinstance(source, bytes) else source) as f:
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
        self.history, self.chunk = policy_cfg.frames(), policy_cfg.actions()
        positions = None if data.frame_in_episode is None else data.frame_in_episode.numpy()
        self.episode_ends = as_tensor_episode_ends(positions) if self.chunk > 1 else None
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
        targets, mask = gather_chunks(self.targets, self.episode_ends, idx, self.chunk)
        targets, mask = targets.to(self.device), None if mask is None else mask.to(self.device)
        self.steps += 1
        start = time.perf_counter()
        loss = bc_step(self.model, self.optimizer, inputs, targets, self.batch, self.group,
                       self.dense, mask)  # float(): a host sync, so on CUDA the step time covers the kernels
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
    init_state = None if init_path is None else torch.load(init_path, weights_only=True)
    saves = (0 if group is None else dist.get_rank(group)) == 0
    return train_loaded(load_npz(data_path), out_path if saves else None, policy_cfg, train_cfg, shuffle_cfg, seed,
                        max_steps, group, device, init_state)


def train_loaded(
    raw: _Data,
    out_path: Path | None,
    policy_cfg: PolicyConfig,
    train_cfg: TrainConfig,
    shuffle_cfg: ShuffleConfig,
    seed: int,
    max_steps: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    init_state: dict[str, torch.Tensor] | None = None,
) -> ExpertParallelResult:
    """``train_expert_parallel`` on data already in memory; ``out_path`` None: this rank saves nothing."""
    from components.config import SchedulerConfig
    from components.training.imitation import TrainingSet
    from components.training.trainer import Trainer
    from components.training.workflow import TrainSpec

    world = 1 if group is None else dist.get_world_size(group)
    torch.set_num_threads(max(1, train_cfg.threads) if world > 1 else (train_cfg.threads or torch.get_num_threads()))
    data = TrainingSet(raw.states.numpy(), raw.actions.numpy(), None if raw.weights is None else raw.weights.numpy(),
                       None if raw.frame_in_episode is None else raw.frame_in_episode.numpy())
    total = total_steps(len(data.states), train_cfg.batch_size, train_cfg.epochs)
    spec = TrainSpec(
        data=data, policy=policy_cfg, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
        batch_size=train_cfg.batch_size, seed=seed, total_steps=min(total, max_steps) if max_steps else total,
        steps_per_iteration=train_cfg.steps_per_iteration,
        init_state=init_state,
        learner_threads=max(1, train_cfg.threads), expert_parallel=shuffle_cfg if group is not None else None,
        device=str(device or "cpu"),
    )
    trainer = Trainer(spec, SchedulerConfig(plan="sequential"))  # collectives: every rank runs ops in one order
    run = trainer.run()
    per_step = [s / spec.steps_in(i) for i, s in enumerate(run.iteration_s) for _ in range(spec.steps_in(i))]
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in run.policy.state_dict().items()}, out_path)
    return ExpertParallelResult(out_path, run.losses, per_step, world, shuffle_cfg.dispatcher if world > 1 else "local",
                                run.shuffle_bytes_sent, [list(u.share) for u in run.expert_usage],
                                [u.dropped_rate for u in run.expert_usage])


# --------------------------------------------------------------------------------------------
# launcher and torchrun entry


def launch_expert_parallel(
    data_path: Path | None,
    out_path: Path,
    policy_cfg: PolicyConfig,
    train_cfg: TrainConfig,
    shuffle_cfg: ShuffleConfig,
    seed: int,
    nproc: int | None = None,
    max_steps: int | None = None,
    timeout_s: float | None = None,
    init_path: Path | None = None,
    distributed: DistributedConfig | None = None,
) -> ExpertParallelResult:
    """Run torchrun on this module for this host (gloo on CPU, NCCL with CUDA: ``shuffle.backend:
    auto``; the NCCL path is written device-agnostic but untested here).

    One host (``distributed.nnodes: 1``): ``torchrun --standalone --nproc-per-node=N``. Several: this
    host's share of a c10d rendezvous; node 0 passes ``data_path`` (and ``init_path``) and gets the
    model at ``out_path``, another node passes ``data_path=None`` and gets the run's figures only.
    ``nproc``: processes on this host (default ``train.world_size / distributed.nnodes``)."""
    distributed = distributed or DistributedConfig()
    nproc = nproc or distributed.nproc_per_node(train_cfg.world_size)
    if (data_path is None) != (distributed.node_rank > 0) or (init_path is not None and distributed.node_rank > 0):
        raise ValueError(f"distributed.node_rank={distributed.node_rank}: node 0, and only node 0, passes the training "
                         "set (and starting weights); the other nodes receive them from it")
    shuffle_cfg = shuffle_for_topology(shuffle_cfg, distributed, nproc)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    config_path = out_path.with_suffix(CONFIG_SUFFIX)
    config_path.write_text(json.dumps({
        "policy": policy_cfg.model_dump(mode="json"),
        "train": train_cfg.model_dump(mode="json"),
        "shuffle": shuffle_cfg.model_dump(mode="json"),
        "nnodes": distributed.nnodes,
    }))
    result_path = out_path.with_suffix(RESULT_SUFFIX)
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(distributed, nproc),
           "-m", "components.training.expert_parallel", "--out", str(out_path), "--config", str(config_path),
           "--seed", str(seed), "--node-rank", str(distributed.node_rank)]
    if data_path is not None:
        cmd += ["--data", str(data_path)]
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    if init_path is not None:
        cmd += ["--init", str(init_path)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", distributed.socket_ifname)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not result_path.exists():
        raise ExpertParallelError(_failure_message(proc, cmd, distributed))
    raw = json.loads(result_path.read_text())
    raw["state_dict_path"] = None if raw["state_dict_path"] is None else Path(raw["state_dict_path"])
    return ExpertParallelResult(**raw)


def _failure_message(proc: subprocess.CompletedProcess, cmd: list[str], distributed: DistributedConfig) -> str:
    """One line for what went wrong: a worker's own error, the rendezvous, else the command + stderr tail."""
    for line in proc.stderr.splitlines():
        if line.startswith(ERROR_MARKER):
            return f"node {distributed.node_rank}: {line[len(ERROR_MARKER):]}"
    where = f"rendezvous {distributed.rdzv_id!r} at {distributed.rdzv_endpoint}"
    if "RendezvousTimeoutError" in proc.stderr:
        return (f"node {distributed.node_rank}: {where}: not all distributed.nnodes={distributed.nnodes} nodes joined "
                f"within distributed.rdzv_timeout_s={distributed.rdzv_timeout_s} s. Fix: start the other hosts within "
                "that time, each with the same params.yaml (node 0: the loop, e.g. fleetloop retrain; node N: "
                "fleetloop train-node --node-rank N), or raise distributed.rdzv_timeout_s")
    if "RendezvousConnectionError" in proc.stderr:
        return (f"node {distributed.node_rank}: {where}: the rendezvous store could not be reached within "
                f"distributed.rdzv_timeout_s={distributed.rdzv_timeout_s} s. Fix: start node 0 (its host serves "
                "the store at distributed.rdzv_endpoint) and check that this host reaches that address and port")
    return (f"expert-parallel training failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stderr[-STDERR_TAIL:]}")


def _backend(cfg: ShuffleConfig) -> str:
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return cfg.backend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="expert-parallel BC training (run under torchrun)")
    parser.add_argument("--data", type=Path, default=None,
                        help=".npz with states, actions[, weights]; node 0 only (the others receive it)")
    parser.add_argument("--out", type=Path, required=True,
                        help="node 0 saves the full state_dict here; every node writes OUT.result.json")
    parser.add_argument("--config", type=Path, required=True, help="JSON with policy, train, shuffle sections")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--init", type=Path, default=None, help="full state_dict to fine-tune (the champion's)")
    parser.add_argument("--node-rank", type=int, default=0, help="distributed.node_rank of this host")
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
        spec = run_spec(policy_cfg, train_cfg, shuffle_cfg, args.seed, args.max_steps, cfg.get("nnodes", 1))
        source = agree_on_run(spec, args.node_rank, args.data is not None)
        inputs = share_inputs(source, read_inputs(args.data, args.init) if dist.get_rank() == source else None)
        rank = dist.get_rank()
        result = train_loaded(load_npz(inputs.data, "node 0's training set"), args.out if rank == source else None,
                              policy_cfg, train_cfg, shuffle_cfg, args.seed, args.max_steps, dist.group.WORLD, device,
                              load_init(inputs))
        if rank == source or (args.node_rank > 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0):
            raw = asdict(result)
            raw["state_dict_path"] = str(result.state_dict_path) if rank == source else None
            raw.update(node_rank=args.node_rank, data_sha256=inputs.data_sha256)
            args.out.with_suffix(RESULT_SUFFIX).write_text(json.dumps(raw))
        dist.barrier()
    except NodeMismatchError as exc:  # every rank raises it: one line each, picked up by the launcher
        print(f"{ERROR_MARKER}{exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
