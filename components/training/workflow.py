"""The training iteration as a scheduler workflow: what every trainer of the project runs.

One iteration ``i`` (``train.steps_per_iteration`` optimizer steps):

    sample    batch@i                <- (seeded by seed, i)    frames drawn by weight from the training set
                                                               (windows of ``policy.history`` frames for a
                                                               history policy: ``policy/history.py``; a
                                                               chunk policy's targets: the frame's next
                                                               ``policy.chunk_size`` actions, masked past
                                                               its episode's end; its weight = its first
                                                               frame's)
    learn     params@i+1, stats@i    <- batch@i, params@i      ``bc.bc_step`` on each of the iteration's batches
                                                               (stats: losses; MoE: expert usage per step)
    validate  valm@i                 <- params@i               rollouts of the weights on validation robots (side)

A vision policy (``policy.kind: vision``) adds a stage between the two: ``sample`` gathers the
batch's states and uint8 camera frames (``frames@i``), ``augment`` shifts each image by a seeded
offset (``batch@i``: a ``CameraBatch``, pixels still uint8, ``training/augment.py``), the learner
packs each step's state and pixels into the policy's observation vectors, and the validation
rollouts render the robots' cameras. Like ``sample``,
``augment`` depends on nothing but ``i``: a plan may run both ahead of the learner, elsewhere.

``sample`` depends on nothing but the iteration index, so a plan may run it ahead of the learner;
``validate`` only reads ``params@i``, so a plan may overlap it with the next learning steps (e.g.
in its own process). The plan changes how long an iteration takes, never the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from components.config import PolicyConfig, ShuffleConfig, SimConfig
from components.policy.factory import make_policy
from components.policy.history import as_tensor_episode_ends, as_tensor_positions, gather_chunks, gather_windows
from components.policy.moe import step_usage
from components.policy.normalizer import NormalizedPolicy
from components.policy.observation import ObservationLayout
from components.scheduler.workflow import BuildContext, Component, OpSpec, StateSpec, Workflow
from components.training.augment import CameraBatch, augment, jitter_states
from components.training.bc import as_weights, batch_indices, bc_step, make_optimizer, scheduled_lr
from components.training.imitation import TrainingSet

VALIDATION_STREAM = 4099


@dataclass(frozen=True)
class ValidationSpec:
    """Rollouts of each iteration's starting weights on robots that never collect training data."""

    sim: SimConfig
    robot_ids: tuple[str, ...]
    episodes_per_robot: int
    seed: int


@dataclass(frozen=True)
class TrainSpec:
    """Everything a training run depends on (picklable: process workers build from it)."""

    data: TrainingSet
    policy: PolicyConfig
    lr: float
    weight_decay: float
    batch_size: int
    seed: int
    total_steps: int
    steps_per_iteration: int
    init_state: dict[str, torch.Tensor] | None = None  # fine-tune these weights (normalizers included)
    validation: ValidationSpec | None = None
    learner_threads: int = 1
    expert_parallel: ShuffleConfig | None = None  # set on torchrun ranks: experts sharded over the world
    device: str = "cpu"  # the learner's device (a torchrun rank's GPU); batches and snapshots move
    lr_schedule: str = "constant"  # train.lr_schedule: each step's rate (bc.scheduled_lr)
    state_noise: float = 0.0  # train.state_noise: input jitter in units of each state number's std

    def __post_init__(self) -> None:
        if self.steps_per_iteration < 1 or self.total_steps < 1:
            raise ValueError("train.steps_per_iteration and the step count must be >= 1")

    @property
    def iterations(self) -> int:
        return -(-self.total_steps // self.steps_per_iteration)

    def steps_in(self, iteration: int) -> int:
        """Steps of iteration ``iteration``: the last one takes the remainder. Iterations past the
        run (the scheduler's profiling and measuring runs) are full ones."""
        left = self.total_steps - iteration * self.steps_per_iteration
        return self.steps_per_iteration if left <= 0 else min(self.steps_per_iteration, left)

    @property
    def obs_dim(self) -> int:
        return int(self.data.states.shape[1])

    @property
    def act_dim(self) -> int:
        return int(self.data.actions.shape[1])

    @property
    def layout(self) -> ObservationLayout:
        """What the policy observes: the state, plus the training set's cameras for a vision policy."""
        return self.data.layout

    @property
    def sees_cameras(self) -> bool:
        return self.policy.kind == "vision"

    def new_policy(self) -> NormalizedPolicy:
        """A fresh (unfitted) policy of this run's kind and observation layout."""
        return make_policy(self.obs_dim, self.act_dim, self.policy, self.layout)


def initial_policy(spec: TrainSpec) -> NormalizedPolicy:
    """The starting weights: ``init_state`` (fine-tuning), else fresh ones with normalizers fitted on the data."""
    torch.manual_seed(spec.seed)
    policy = spec.new_policy()
    if spec.init_state is not None:
        policy.load_state_dict(spec.init_state)
    else:
        policy.fit(torch.as_tensor(spec.data.states), torch.as_tensor(spec.data.actions))
    return policy


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Sampler:
    def __init__(self, spec: TrainSpec) -> None:
        self.spec = spec
        self.states = torch.as_tensor(spec.data.states, dtype=torch.float32)
        self.actions = torch.as_tensor(spec.data.actions, dtype=torch.float32)
        self.weights = as_weights(spec.data.weights)
        self.positions = as_tensor_positions(spec.data.frame_in_episode)
        self.history = spec.policy.frames()
        self.chunk = spec.policy.actions()
        self.episode_ends = as_tensor_episode_ends(spec.data.frame_in_episode) if self.chunk > 1 else None
        # a vision policy's camera frames, uint8, shared with the training set (no copy)
        self.images = {key: torch.from_numpy(frames) for key, frames in (spec.data.images or {}).items()
                       if spec.sees_cameras}
        rank, world = _world() if spec.expert_parallel is not None else (0, 1)
        if spec.batch_size % world:
            raise ValueError(f"train.batch_size={spec.batch_size} must be a multiple of the {world} ranks")
        share = spec.batch_size // world
        self.local = slice(rank * share, (rank + 1) * share)  # this rank's slice of every global batch
        # the state jitter's std per number: train.state_noise x the training set's std (0: none)
        self.noise_scale = spec.state_noise * self.states.std(0) if spec.state_noise > 0 else None


class Learner:
    def __init__(self, spec: TrainSpec) -> None:
        from components.policy.moe import enable_expert_parallel, expert_parameter_names

        self.spec = spec
        self.device = torch.device(spec.device)
        self.policy = initial_policy(spec).to(self.device)
        self.group = None
        if spec.expert_parallel is not None and _world()[1] > 1:
            self.group = dist.group.WORLD
            enable_expert_parallel(self.policy, self.group, spec.expert_parallel)
        experts = expert_parameter_names(self.policy)
        self.dense = [p for name, p in self.policy.named_parameters() if name not in experts]
        self.optimizer = make_optimizer(self.policy, spec.lr, spec.weight_decay)
        self.policy.train()
        self.version = 0  # the iteration whose starting weights the policy holds


class Validator:
    def __init__(self, spec: TrainSpec) -> None:
        self.spec = spec
        self.policy = spec.new_policy()


class Augmenter:
    def __init__(self, spec: TrainSpec) -> None:
        self.spec = spec
        self.layout = spec.layout


def op_sample(s: Sampler, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    i = idx["iteration"]
    rows = batch_indices(len(s.states), s.weights, s.spec.batch_size, s.spec.steps_in(i), s.spec.seed, i)
    rows = rows[:, s.local]
    targets, mask = gather_chunks(s.actions, s.episode_ends, rows, s.chunk)
    inputs = gather_windows(s.states, s.positions, rows, s.history)
    if s.noise_scale is not None:
        inputs = jitter_states(inputs, s.noise_scale, s.spec.seed, i, s.spec.batch_size, s.local)
    batch = (inputs, targets) if mask is None else (inputs, targets, mask)
    if s.images:  # a vision policy: the frames go to ``augment``, which shifts them
        return {"frames": (batch, {key: frames[rows] for key, frames in s.images.items()})}
    return {"batch": batch}


def op_augment(a: Augmenter, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    i = idx["iteration"]
    (states, *rest), frames = inp["frames"]
    return {"batch": (augment(states, frames, a.layout, a.spec.policy.augment_shift, a.spec.seed, i), *rest)}


def op_learn(ls: Learner, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    i = idx["iteration"]
    if ls.version != i:  # the learner was rebuilt elsewhere (e.g. a resumed run): take the weights
        ls.policy.load_state_dict(inp["params"])
    states, actions, *mask = (x.to(ls.device) for x in inp["batch"])
    targets = ls.policy.act_norm.normalize(actions)
    losses, usage = [], []
    for k in range(len(states)):
        _set_lr(ls, i * ls.spec.steps_per_iteration + k)
        obs = states.step(k) if isinstance(states, CameraBatch) else states[k]  # a vision batch packs here
        losses.append(bc_step(ls.policy, ls.optimizer, obs, targets[k], ls.spec.batch_size, ls.group, ls.dense,
                              mask[0][k] if mask else None))
        usage.append(step_usage(ls.policy))
    ls.version = i + 1
    stats: dict[str, Any] = {"losses": losses}
    if usage and usage[0] is not None:
        stats["expert_usage"] = usage
    if ls.group is not None:
        from components.policy.moe import moe_layers

        stats["shuffle_bytes_sent"] = sum(layer.dispatcher.transport.meter.bytes_sent
                                          for layer in moe_layers(ls.policy) if layer.dispatcher)
    return {"params": _snapshot(ls, last=i + 1 == ls.spec.iterations), "stats": stats}


def _set_lr(ls: Learner, step: int) -> None:
    rate = scheduled_lr(ls.spec.lr, ls.spec.lr_schedule, step, ls.spec.total_steps)
    for group in ls.optimizer.param_groups:
        group["lr"] = rate


def _snapshot(ls: Learner, last: bool) -> dict[str, torch.Tensor]:
    """The weights after this iteration, for the validator and the caller. Sharded experts are
    gathered only after the last iteration (it is a collective; expert-parallel runs do not validate)."""
    if ls.group is None:
        return {k: v.detach().cpu().clone() for k, v in ls.policy.state_dict().items()}
    if not last:
        return {}
    from components.policy.moe import full_expert_state

    return {k: v.detach().cpu() for k, v in full_expert_state(ls.policy, ls.group).items()}


def op_validate(v: Validator, idx: dict[str, int], inp: dict[str, Any]) -> dict[str, Any]:
    from components.policy.actor import PolicyActor
    from components.sim.collect import run_episodes
    from components.sim.factory import make_thresholded

    val = v.spec.validation
    assert val is not None
    v.policy.load_state_dict(inp["params"])
    actor = make_thresholded(val.sim, PolicyActor(v.policy))
    episodes = run_episodes(actor, list(val.robot_ids), val.sim, val.episodes_per_robot,
                            val.seed * 1000 + VALIDATION_STREAM, "validation")
    return {"valm": {"success_rate": float(np.mean([e.success for e in episodes])), "trials": len(episodes)}}


def _sampler(ctx: BuildContext) -> Sampler:
    return Sampler(ctx.payload)


def _learner(ctx: BuildContext) -> Learner:
    return Learner(ctx.payload)


def _validator(ctx: BuildContext) -> Validator:
    return Validator(ctx.payload)


def _augmenter(ctx: BuildContext) -> Augmenter:
    return Augmenter(ctx.payload)


def train_workflow(spec: TrainSpec, groups: int = 1) -> Workflow:
    """The training workflow (no env groups: ``groups`` is accepted for the runtime and ignored)."""
    del groups
    comps = [Component("sampler", _sampler), Component("learner", _learner, exclusive=True, memory_mb=4.0,
                                                       process_ok=spec.expert_parallel is None)]
    states = [StateSpec(n) for n in ("batch", "params", "stats")]
    body = [OpSpec("sample", "sampler", op_sample, reads=(), writes=("batch@iteration",))]
    if spec.sees_cameras:  # sample -> frames -> augment -> batch
        comps.append(Component("augmenter", _augmenter))
        states.append(StateSpec("frames"))
        body = [OpSpec("sample", "sampler", op_sample, reads=(), writes=("frames@iteration",)),
                OpSpec("augment", "augmenter", op_augment, reads=("frames@iteration",), writes=("batch@iteration",))]
    body += [
        OpSpec("learn", "learner", op_learn, reads=("batch@iteration", "params@iteration"),
               writes=("params@iteration+1", "stats@iteration"), quota_invariant=False),
    ]
    if spec.validation is not None:
        comps.append(Component("validator", _validator, stateless=True))  # loads the weights it reads
        states.append(StateSpec("valm"))
        body.append(OpSpec("validate", "validator", op_validate, reads=("params@iteration",),
                           writes=("valm@iteration",), side=True))
    return Workflow("train", tuple(comps), tuple(states), {}, tuple(body))
