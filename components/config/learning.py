"""Learning: the policy network (``policy``), the trainer (``train``), FERT (``fert``) and the
failure explorer (``explain``), the MoE token shuffle (``shuffle``), training over several hosts
(``distributed``) and the embedded scheduler (``scheduler``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from components.config.base import Section


class PolicyConfig(Section):
    """Which torch policy, and its size (components/policy/README.md).

    ``mlp``: ``layers`` x ``hidden`` on the current observation. ``moe_transformer``: the last
    ``history`` observations as tokens, ``layers`` pre-norm blocks of causal self-attention + a
    mixture-of-experts feed-forward (``num_experts`` experts of width ``hidden``, ``top_k`` routing),
    the current frame's token -> action. Its trained loss adds ``aux_loss_weight`` x the Switch
    load-balancing loss and ``z_loss_weight`` x the router z-loss; in training each expert takes at
    most ``capacity_factor`` x its fair share of (token, expert) pairs (0 = no limit), and a dropped
    pair passes through the residual. Deployed (eval mode) nothing is dropped, so a robot's action
    never depends on which other robots share its batch. ``chunk_transformer`` (ACT-style): the same
    ``history`` frame tokens plus ``chunk_size`` learned action queries through ``layers`` blocks
    (feed-forward ``chunk_ffn``: dense of width ``hidden``, or the MoE above), one action per query:
    the next ``chunk_size`` actions. Executed with temporal ensembling: a new chunk every
    ``replan_every`` steps, each step's action the average of every stored chunk's prediction for it,
    weighted ``exp(-ensemble_decay * i)`` (i = 0 the oldest; ACT's m). ``vision``: a conv encoder
    per camera of ``cameras`` (``vision_channels`` channels, spatial softmax, ``vision_feature``
    numbers each), with the state beside them if ``vision_state``, then ``layers`` x ``hidden``; it
    predicts ``vision_chunk`` actions per decision and trains on images shifted by up to
    ``augment_shift`` pixels (seeded: ``training/augment.py``). ``head``: ``mse`` (one action,
    squared error) or ``gmm`` (mlp / moe_transformer: ``mixtures`` Gaussians by likelihood, each std
    at least ``mixture_min_std``, the likeliest one's mean executed: ``policy/mixture.py``) or
    ``binary_jaw`` (any kind: the last action number, every built-in sim's jaw, is a close logit
    trained by cross-entropy on the demo's open/close, executed as ``2 sigmoid - 1``; the other
    numbers by squared error: ``policy/normalizer.py``).
    """

    kind: Literal["mlp", "moe_transformer", "chunk_transformer", "vision"] = "mlp"
    hidden: int = Field(default=256, ge=1)
    layers: int = Field(default=3, ge=1)
    # MoE transformer
    d_model: int = Field(default=64, ge=1)
    heads: int = Field(default=4, ge=1)
    num_experts: int = Field(default=8, ge=1)
    top_k: int = Field(default=2, ge=1)
    history: int = Field(default=2, ge=1)  # observation frames per decision (moe_transformer)
    aux_loss_weight: float = Field(default=0.01, ge=0)  # Switch load-balancing loss
    z_loss_weight: float = Field(default=1e-3, ge=0)  # router z-loss (ST-MoE)
    capacity_factor: float = Field(default=1.25, ge=0)  # training only; 0 = unlimited
    # chunk_transformer
    chunk_size: int = Field(default=8, ge=1)  # actions predicted per decision (ACT's k)
    chunk_ffn: Literal["dense", "moe"] = "dense"  # moe: the MoE feed-forward above (fused shuffle when sharded)
    replan_every: int = Field(default=1, ge=1)  # steps between chunk queries at execution (<= chunk_size)
    ensemble_decay: float = 0.01  # temporal ensembling weight exp(-m * i), i = 0 the oldest prediction
    # vision (components/policy/vision.py): needs sim.cameras and episodes stored with their camera streams
    cameras: tuple[Literal["scene", "gripper"], ...] = ()  # views the policy sees; () = every one sim.cameras renders
    # 16 / 32: a 64x64 two-camera bc_step at batch 256 costs ~180 ms of one core (32 / 64: ~480 ms)
    vision_channels: int = Field(default=16, ge=1)  # conv channels of each camera's encoder
    vision_feature: int = Field(default=32, ge=1)  # numbers each camera's encoder gives the head
    vision_state: bool = True  # the state vector beside the image features
    vision_chunk: int = Field(default=1, ge=1)  # actions predicted per decision (1: this step's)
    augment_shift: int = Field(default=4, ge=0)  # training: random shift of each image by up to this many pixels
    # action head (components/policy/mixture.py): mse = one action by squared error; gmm = a Gaussian
    # mixture by likelihood, the likeliest component's mean executed (mlp and moe_transformer);
    # binary_jaw = mse, but the jaw (the last action number) as an open/close classifier
    head: Literal["mse", "gmm", "binary_jaw"] = "mse"
    mixtures: int = Field(default=5, ge=1)  # gmm: components per decision
    mixture_min_std: float = Field(default=0.01, gt=0)  # gmm: floor of each std, normalized action units

    @model_validator(mode="after")
    def _mixture_on_single_actions(self) -> PolicyConfig:
        if self.head == "gmm" and self.kind not in ("mlp", "moe_transformer"):
            raise ValueError(f"policy.head=gmm predicts one action per decision: use it with policy.kind mlp or "
                             f"moe_transformer, not {self.kind!r} (or set policy.head: mse)")
        return self

    @model_validator(mode="after")
    def _replan_within_chunk(self) -> PolicyConfig:
        if self.replan_every > self.chunk_size:
            raise ValueError(f"policy.replan_every={self.replan_every} must be <= policy.chunk_size="
                             f"{self.chunk_size} (a step past the chunk would have no action)")
        return self

    def frames(self) -> int:
        """Observation frames the policy sees per decision (1: the current observation only)."""
        return self.history if self.kind in ("moe_transformer", "chunk_transformer") else 1

    def actions(self) -> int:
        """Actions the policy predicts per decision (1: this step's only)."""
        if self.kind == "vision":
            return self.vision_chunk
        return self.chunk_size if self.kind == "chunk_transformer" else 1

    def camera_views(self, rendered: tuple[str, ...]) -> tuple[str, ...]:
        """The views a vision policy sees, of those the simulator renders (``sim.cameras``); () otherwise."""
        if self.kind != "vision":
            return ()
        views = self.cameras or rendered
        missing = [v for v in views if v not in rendered]
        if missing or not views:
            raise ValueError(f"policy.kind=vision sees cameras {list(views) or '(none)'} but sim.cameras renders "
                             f"{list(rendered) or 'none'}: set sim.cameras (params.yaml or FLEETLOOP_SIM__CAMERAS) "
                             f"to include {missing or ['scene']}")
        return tuple(v for v in ("scene", "gripper") if v in views)


class ShuffleConfig(Section):
    """FUSCO MoE token shuffle for expert-parallel training (components/shuffle)."""

    dispatcher: Literal["fused", "megatron", "dedup_permute"] = "fused"
    # auto: permute at top-1 (Megatron's sequence with reused staging: nothing to dedup), else
    # rank_dedup unless the cost model below says two-level moves fewer weighted bytes
    plan: Literal["auto", "permute", "rank_dedup", "one_level", "two_level"] = "auto"
    grouping: Literal["static", "balanced"] = "balanced"  # two-level forwarder groups
    chunks: int = 1  # pipeline rounds (token blocks) per call; 1 = one round, no overlap
    dedup_threshold: float = 1.5  # auto considers two-level only at >= this many pairs per node crossing
    internode_cost: float = 1.0  # cost of an inter-node byte / an intra-node byte; 1 = one host (two-level never pays)
    collective_cost_kib: int = 256  # auto's price of one extra collective, in KiB of intra-node traffic
    # auto at top-k > 1, when the MoE layer passes the group's pair counts: rank_dedup only if it is
    # expected to save at least this many KiB per rank and layer call (both directions); below, its
    # fixed cost outweighs the rows it saves and the permute sequence runs (SHUFFLE-NOTES: at top-2,
    # ~4 MiB saved per rank, dedup's overhead ate the gain)
    dedup_min_saved_kib: int = 4096
    min_segment_kib: int = 1024  # per-expert messages (zero-copy slots) when segments are this big
    # 0 = every rank on one node (torchrun --standalone); with distributed.nnodes > 1 the launcher
    # sets it to the processes per node, so the two-level plans see the real topology
    ranks_per_node: int = 0
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL when CUDA is present


class DistributedConfig(Section):
    """Expert-parallel training over several hosts: torchrun's c10d rendezvous (components/training/README.md).

    ``train.world_size`` ranks split evenly over ``nnodes`` hosts (``world_size / nnodes`` processes
    each). ``nnodes: 1`` is ``torchrun --standalone`` on this host. Node 0 is the host whose loop
    (retrain flow, ``dvc repro``) builds the training set, sends it to the others over the process
    group and keeps the model; another host joins with ``fleetloop train-node --node-rank N``.
    Every node must run the same params (checked at start, field by field); only the fields marked
    per-host below may differ.
    """

    nnodes: int = Field(default=1, ge=1)
    node_rank: int = Field(default=0, ge=0)  # per host: 0 = the host that builds the data and keeps the model
    # node 0's host:port, where the c10d rendezvous store runs (29400: torchrun's default port)
    rdzv_endpoint: str = "127.0.0.1:29400"
    rdzv_id: str = "fleetloop-train"  # one id per training job; nodes with another id never meet
    rdzv_timeout_s: int = Field(default=600, ge=1)  # per host: all nnodes must join within this, else a clear error
    local_addr: str = "127.0.0.1"  # per host: the address peers reach this host on (torchrun --local-addr, MASTER_ADDR)
    socket_ifname: str = "lo"  # per host: GLOO_SOCKET_IFNAME, the interface gloo's sockets use (e.g. eth0)

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"distributed.rdzv_endpoint={value!r} must be HOST:PORT, e.g. node0.example.com:29400")
        return value

    @model_validator(mode="after")
    def _rank_in_range(self) -> DistributedConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"distributed.node_rank={self.node_rank} must be below distributed.nnodes={self.nnodes}")
        return self

    def nproc_per_node(self, world_size: int) -> int:
        """Processes per host for ``world_size`` ranks; they must split evenly."""
        if world_size % self.nnodes:
            raise ValueError(f"train.world_size={world_size} must be a multiple of distributed.nnodes={self.nnodes} "
                             "(every host runs the same number of ranks)")
        return world_size // self.nnodes


class TrainConfig(Section):
    """The one trainer (components/training/trainer.py): weighted BC run as a scheduler workflow."""

    # which frames to imitate and how often (components/fert/methods.py): fert is the product;
    # bc (demos), filtered_bc (every success) and fert_uniform are baselines of the same workflow
    method: Literal["bc", "filtered_bc", "fert", "fert_uniform"] = "fert"
    epochs: int = Field(default=30, ge=1)  # steps = epochs x frames / batch_size
    batch_size: int = Field(default=256, ge=1)
    lr: float = 1e-3
    # constant, or cosine: each step's rate decays from lr to 0 over the run (diffusion policy's recipe)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # training: each state number of a batch's inputs jittered by N(0, (this x its training-set std)^2),
    # seeded (training/augment.jitter_states); the targets stay clean. 0 = off
    state_noise: float = Field(default=0.0, ge=0)
    weight_decay: float = 1e-4
    world_size: int = Field(default=1, ge=1)  # > 1: expert-parallel ranks under torchrun (MoE policy)
    threads: int = Field(default=0, ge=0)  # learner intra-op threads, the same in every plan; 0 = 1
    log_every: int = 50
    steps_per_iteration: int = Field(default=50, ge=1)  # optimizer steps per workflow iteration
    validation_robots: int = Field(default=4, ge=0)  # validation rollouts each iteration (0 = none)
    validation_episodes: int = Field(default=1, ge=1)  # per validation robot and iteration
    # what the train task runs: imitation (the method above, through the trainer's workflow), or
    # PPO on the built-in simulator (components/pipeline/scheduled.py); both through the scheduler
    workload: Literal["imitation", "ppo"] = "imitation"


class FertConfig(Section):
    """Failure-guided experience retrieval fine-tuning (components/fert/README.md)."""

    # divergence detector: a failed episode diverges at the first window that starts a run of
    # `consecutive` windows whose nearest success window is farther than the `percentile`-th
    # percentile of success-to-success nearest distances
    percentile: float = Field(default=90.0, gt=0, lt=100)
    consecutive: int = Field(default=3, ge=1)
    calibrate: bool = True  # raise `consecutive` until held-out successes fire <= max_false_fire
    max_false_fire: float = Field(default=0.05, ge=0, le=1)
    max_consecutive: int = Field(default=8, ge=1)
    calibration_episodes: int = Field(default=200, ge=2)  # held-out successes (half threshold, half false-fire)
    fallback_steps: int = Field(default=16, ge=1)  # no divergence found: the last W steps are the context
    failures_from: Literal["champion", "all"] = "champion"  # failed episodes of the collecting policy, or all
    max_queries: int = Field(default=2048, ge=1)  # failure-context windows queried (seeded subsample above)
    # retrieval
    top_k: int = Field(default=16, ge=1)
    max_distance_percentile: float = Field(default=95.0, gt=0, le=100)  # drop matches beyond this
    # the store's window encoder, fitted by the first ingest (components/fert/README.md, "Window encoders"):
    # normalized_state | learned (states -> actions) | camera (camera frames -> actions, fert/camera_encoder.py)
    encoder: Literal["normalized_state", "learned", "camera"] = "normalized_state"
    learned_dim: int = Field(default=16, ge=1)  # code length of the learned and camera encoders
    learned_epochs: int = Field(default=20, ge=1)  # their passes over the success windows
    # camera encoder: needs episodes stored with their camera streams (sim.cameras)
    camera_views: tuple[str, ...] = ()  # views it sees (scene, gripper); () = every camera stream the dataset stores
    camera_size: int = Field(default=16, ge=4)  # frames block-averaged down to size x size (64 px: 4x4 blocks)
    camera_frames: int = Field(default=3, ge=1)  # frames of a window it looks at, evenly spaced first..last
    camera_channels: int = Field(default=8, ge=1)  # conv channels per view (keypoints = channels, spatial softmax)
    camera_state: bool = False  # also the window's z-scored states (false: the vectors are the cameras' alone)
    camera_max_windows: int = Field(default=8192, ge=1)  # success windows it fits on (seeded pick of episodes above)
    # priority w = 1 + alpha * sum_q exp(-d^2 / 2 sigma^2)
    alpha: float = Field(default=1.0, ge=0)
    sigma: float = Field(default=0.0, ge=0)  # 0 = median retrieved distance
    # a match credits the success's frames from this many steps after the matched segment's start:
    # 0 = the matched segment itself; store.window = what the success did next from that situation
    credit_lead: int = Field(default=4, ge=0)
    # batch mix of the three pools (renormalized over the non-empty pools)
    mix_demos: float = Field(default=0.05, ge=0)
    mix_successes: float = Field(default=0.75, ge=0)
    mix_retrieved: float = Field(default=0.2, ge=0)
    # loop removal: a success frame whose state the same episode is still near later (within this
    # many median steps, states scaled by the success frames' std) is not imitated; 0 = off
    revisit_radius: float = Field(default=0.75, ge=0)


class ExplainConfig(Section):
    """The failure explorer (components/fert/explorer.py): each failure context of a FERT round beside
    the success windows it retrieved, one page per robot and per stage, and the stage-failure table."""

    enabled: bool = True  # the retrain flow explains every fert round (`fleetloop explain` always can)
    failures_per_page: int = Field(default=6, ge=1)  # rows of a page, one failure each; more are left out (said on the page)
    windows_shown: int = Field(default=3, ge=1)  # nearest distinct retrieved windows beside each failure
    max_robot_pages: int = Field(default=12, ge=1)  # robots with the most failures first; the rest are listed
    dpi: int = Field(default=72, ge=30)


class SchedulerConfig(Section):
    """Rose + M2Flow scheduler: executor, profiler, planner, graph optimizer, quotas."""

    # executor
    channel_capacity: int = 256  # items waiting in one worker's inbox before put() blocks
    channel_timeout_s: float = 120.0  # a put/get waiting longer fails the run (deadlocked plan)
    devices: int = 0  # CPU devices (cores) the plan may use; 0 = all cores
    memory_budget_mb: float = 0.0  # per device; 0 = unlimited
    gil_switch_interval_us: float = 200.0  # while >1 worker thread runs (Python default 5000); 0 = leave
    op_threads: int = 1  # intra-op threads per op in the baselines, the profile and the plans; 0 = all cores
    pin_cores: bool = False  # pin disaggregated workers to their cores (hurts on a machine shared with other jobs)
    # profiler
    sample_interval_ms: float = 20.0  # /proc CPU times tick every 10 ms: sample slower than that
    profile_iterations: int = 3  # per profiled stage count; the first is warm-up and dropped
    gpu_telemetry: bool = True
    # planning only on a qualified capacity reading: re-probe until the probe shows this share of
    # the cores (a host that steals a core for a moment must not decide the plan), else plan on the
    # best reading seen and say so in the plan's notes
    capacity_qualify_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    capacity_probe_attempts: int = Field(default=5, ge=1)
    capacity_retry_wait_s: float = Field(default=2.0, ge=0.0)
    ipc_probe_iterations: int = Field(default=2, ge=1)  # process-worker run that measures IPC per op (bytes, s)
    # M2Flow planner
    pipeline_stages: tuple[int, ...] = (1, 2, 4)  # candidate env-group counts m
    cost_curves: tuple[str, ...] = ("power", "exponential", "log", "quadratic")
    # Rose graph optimizer + quotas
    validate_iterations: int = 3  # measured iterations per run in an accept/rollback decision
    validate_rounds: int = 2  # interleaved runs (A B A B ...) per plan in such a decision
    accept_margin: float = 0.02  # a change is kept only if measured faster by this fraction
    activity_threshold: float = 0.75  # busy fraction of devices below which a window is low-activity
    min_window_ms: float = 2.0
    quota_max_steps: int = 4
    # which schedule training uses: auto = profiled once per machine and workload shape (cached
    # under <root>/.fleetloop/plans), M2Flow + Rose propose, kept only if measured faster
    plan: Literal["auto", "sequential", "coarse", "planner", "rose"] = "auto"
    # workloads the Prefect train task runs through the scheduler (train.workload)
    iterations: int = Field(default=10, ge=1)
    ppo_steps: int = Field(default=64, ge=1)  # rollout steps per iteration (all fleet robots as envs)
    ppo_epochs: int = Field(default=2, ge=1)
    ppo_minibatches: int = Field(default=4, ge=1)
    ppo_eval_steps: int = Field(default=32, ge=1)  # held-out evaluation of the previous weights
