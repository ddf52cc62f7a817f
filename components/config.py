"""One typed settings object for all of fleetloop.

Built from ``params.yaml`` (found at the root, else beside this package) and overridden by
environment variables: ``FLEETLOOP_ROOT`` for the root, ``FLEETLOOP_<SECTION>__<KEY>`` for any
field (e.g. ``FLEETLOOP_TRAIN__EPOCHS=3``).

Each section is the config of one component room; components receive *their* section object and
never read the environment themselves. This module imports nothing from the rest of
``components`` so every room may depend on it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
PARAMS_FILE = "params.yaml"


class Section(BaseModel):
    """A config section: unknown keys are errors, so a typo in params.yaml is caught."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PackConfig(Section):
    """The built-in pack task's knobs (``sim.name: pack``, components/sim/pack.py): how hard the
    container is to hit and to push. Tuned only against the difficulty criteria of
    components/sim/README.md ("pack")."""

    container_radius: float = Field(default=0.06, gt=0)  # an object released within this of the container's centre is in it
    push_radius: float = Field(default=0.07, gt=0)  # a closed jaw this close to the container's centre pushes it
    goal_radius: float = Field(default=0.07, gt=0)  # the container must end within this of its goal
    push_distance_min: float = Field(default=0.15, gt=0)  # the container's goal lies this far ...
    push_distance_max: float = Field(default=0.30, gt=0, le=0.35)  # ... to this far from its start
    push_angle_spread: float = Field(default=0.79, ge=0, le=math.pi)  # goal direction: +y +- this (radians)
    push_scatter: float = Field(default=0.1, ge=0)  # sideways drift std per unit pushed (uneven friction)
    spill_scale: float = Field(default=1.0, ge=0)  # spill chance per push step = robot's slip_rate x this x speed^2

    @field_validator("push_distance_max")
    @classmethod
    def _distances_ordered(cls, v: float, info: Any) -> float:
        low = info.data.get("push_distance_min", 0.0)
        if v < low:
            raise ValueError(f"sim.pack.push_distance_max={v} is below push_distance_min={low}: raise it")
        return v


class CameraConfig(Section):
    """The sims' RGB cameras (components/sim/camera.py): image size, what the gripper view spans, and
    how widely the robots' camera quirks spread (each robot draws its own within these, from its
    profile: components/sim/profile.py). Which views render is ``sim.cameras``."""

    width: int = Field(default=64, ge=8, multiple_of=2)  # even: the stored video is yuv420p
    height: int = Field(default=64, ge=8, multiple_of=2)
    gripper_view_half_width: float = Field(default=0.2, gt=0)  # the gripper view spans +- this around the jaw
    mount_offset_spread: float = Field(default=0.03, ge=0)  # camera shift in +- spread (workspace units)
    mount_rotation_spread: float = Field(default=0.06, ge=0)  # camera roll in +- spread (radians)
    exposure_spread: float = Field(default=0.25, ge=0, lt=1)  # brightness gain in 1 +- spread
    white_balance_spread: float = Field(default=0.1, ge=0, lt=1)  # per-channel gain in 1 +- spread
    pixel_noise_max: float = Field(default=8.0, ge=0)  # pixel noise std in [0, max] (of 255)
    drop_rate_max: float = Field(default=0.05, ge=0, lt=1)  # chance a frame is dropped (the last one repeats)
    mujoco_gl: Literal["osmesa", "egl", "glfw"] = "osmesa"  # Meta-World's offscreen GL (MUJOCO_GL)
    metaworld_scene_camera: str = "corner"  # Meta-World cameras for the scene / gripper views
    metaworld_gripper_camera: str = "gripperPOV"


class SimConfig(Section):
    """The built-in tasks (pick-place, pack) and their per-robot heterogeneity."""

    name: Literal["pickplace", "metaworld", "pack"] = "pickplace"
    task: str = "pick-place"
    max_steps: int = Field(default=120, gt=0)
    control_hz: float = Field(default=10.0, gt=0)
    # per-robot heterogeneity, drawn once from the robot id (each robot draws within these)
    gain_spread: float = Field(default=0.15, ge=0, lt=1)  # action gain in 1 +- spread
    bias_spread: float = Field(default=0.03, ge=0)  # action bias in +- spread (action units)
    obs_noise_max: float = Field(default=0.01, ge=0)  # position noise std in [0, max]
    placement_spread: float = Field(default=0.10, ge=0)  # object/goal region offset in +- spread
    grasp_miss_max: float = Field(default=0.06, ge=0, le=1)  # chance a well-aimed grasp misses
    slip_rate_max: float = Field(default=0.01, ge=0, le=1)  # per-step slip chance at full speed
    # which draw of quirks a robot id gets: a profile comes from (population_seed, robot id);
    # 0 = the original population (profiles hashed from the id alone, bit for bit as before)
    population_seed: int = Field(default=0, ge=0)
    # exploration of the executed policy (fleet collection only)
    gripper_flip_prob: float = Field(default=0.03, ge=0, le=1)
    gripper_sample_gain: float = Field(default=4.0, gt=0)  # p(close) = sigmoid(gain * command)
    motion_noise_std: float = Field(default=0.35, ge=0)  # Gaussian noise on executed motion commands
    pack: PackConfig = PackConfig()  # sim.name: pack only
    # RGB camera views every robot renders ("scene", "gripper"); () = none, state only (the default)
    cameras: tuple[Literal["scene", "gripper"], ...] = ()
    camera: CameraConfig = CameraConfig()


class FleetConfig(Section):
    """Who is in the fleet and how long each robot collects per round."""

    num_robots: int = 8
    robot_prefix: str = "robot"
    # robot roles (docs: DESIGN.md "Evaluation protocol"); a role is the id's prefix, so roles never overlap
    heldout_prefix: str = "heldout"  # the product gate's robots (the study settings were tuned on them)
    tuning_prefix: str = "tuning"  # the only robots any setting may be chosen on
    validation_prefix: str = "validation"  # robots for selection during training: never collect, never reported
    test_prefix: str = "test"  # reported only, never used for a decision; drawn fresh per study seed
    num_heldout_robots: int = 16
    steps_per_robot: int = 1200
    extra_robots: tuple[str, ...] = ()
    sample_gripper: bool = True  # explore while collecting: jaw sampled + sim.motion_noise_std
    # test robots of study seed s come from sim population seed test_population_base + s
    test_population_base: int = Field(default=1000, ge=1)

    @model_validator(mode="after")
    def _roles_are_disjoint(self) -> FleetConfig:
        prefixes = self.role_prefixes()
        if len(set(prefixes.values())) != len(prefixes):
            raise ValueError(f"fleet role prefixes must differ (robots of two roles would coincide): {prefixes}")
        return self

    def role_prefixes(self) -> dict[str, str]:
        """Role -> id prefix: collection robots, the gate's held-out robots, tuning, validation, test."""
        return {"fleet": self.robot_prefix, "heldout": self.heldout_prefix, "tuning": self.tuning_prefix,
                "validation": self.validation_prefix, "test": self.test_prefix}

    def robot_ids(self, count: int | None = None) -> list[str]:
        n = self.num_robots if count is None else count
        return [f"{self.robot_prefix}-{i:04d}" for i in range(n)]

    def heldout_ids(self, count: int | None = None) -> list[str]:
        n = self.num_heldout_robots if count is None else count
        return [f"{self.heldout_prefix}-{i:04d}" for i in range(n)]

    def tuning_ids(self, count: int) -> list[str]:
        return [f"{self.tuning_prefix}-{i:04d}" for i in range(count)]

    def validation_ids(self, count: int) -> list[str]:
        return [f"{self.validation_prefix}-{i:04d}" for i in range(count)]

    def test_ids(self, count: int) -> list[str]:
        return [f"{self.test_prefix}-{i:04d}" for i in range(count)]

    def test_population_seed(self, study_seed: int) -> int:
        """The sim population the test robots of ``study_seed`` come from: fresh per seed."""
        return self.test_population_base + study_seed


class VideoConfig(Section):
    """How camera streams are encoded on store (components/episodes/video.py): LeRobot's defaults
    (``VideoEncoderConfig``: AV1 by SVT-AV1, yuv420p, a keyframe every 2 frames, crf 30, preset 12)."""

    codec: Literal["libsvtav1", "h264"] = "libsvtav1"
    pix_fmt: Literal["yuv420p"] = "yuv420p"
    gop: int = Field(default=2, ge=1)  # keyframe interval (LeRobot's g): short = fast random access
    crf: int = Field(default=30, ge=0, le=63)
    preset: int = Field(default=12, ge=0, le=13)  # SVT-AV1 speed preset (13 fastest)
    # where an ingest encodes: "background" = a thread encodes while the data file, tasks and
    # stats are written, joined before the commit; "inline" = before them (benchmarks/vision.py)
    encode: Literal["inline", "background"] = "background"


class EpisodesConfig(Section):
    """Episode dataset on disk (LeRobot v3 layout)."""

    chunk_size: int = 1000  # data files per chunk-XXX folder (LeRobot `chunks_size`)
    fps: float = 10.0  # written to info.json when a dataset is created
    codebase_version: str = "v3.0"
    robot_type: str = "fleetloop"  # info.json `robot_type`
    compression: Literal["snappy", "zstd", "gzip", "none"] = "snappy"  # Parquet codec
    # each ingest commits one episodes-table file; once the newest run of files under meta_file_mb
    # holds meta_merge_files of them, the ingest merges them into one (components/episodes/meta_files.py),
    # so a first open reads tens of files, not one per ingest (1,003 and 8 s at 10M frames)
    meta_merge_files: int = Field(default=64, ge=2)
    meta_file_mb: float = Field(default=16.0, gt=0)
    # ...and merges the data files of those episodes into files of up to data_file_mb (LeRobot's
    # data_files_size_in_mb), so a DVC snapshot walks tens of files, not one per ingest
    # (components/episodes/data_files.py); merged-away files stay readable this long for handles
    # opened before the merge
    data_file_mb: float = Field(default=100.0, gt=0)
    superseded_retain_hours: float = Field(default=24.0, ge=0)
    # every ingest pushes the dataset's DVC snapshot here ("" = the root's DVC cache only):
    # s3://bucket/prefix (keys from env: AWS_ACCESS_KEY_ID, ...) or a shared path
    dvc_remote: str = ""
    dvc_remote_endpoint: str = ""  # an S3-compatible server (MinIO, Ceph, ...); "" = AWS S3
    video: VideoConfig = VideoConfig()  # camera streams (components/episodes/video.py)


STORE_URI_SCHEMES = ("s3", "gs", "az")  # object stores LanceDB reaches (s3 is the one tested)


class StoreConfig(Section):
    """LanceDB segment store of window embeddings (see components/store/README.md)."""

    # where the store lives: "" = <root>/datasets/segments.lance; else s3://bucket/prefix (or an
    # absolute shared path). Endpoint, region and keys come from the environment only
    # (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), read by LanceDB itself
    uri: str = ""
    # an object store not answering is retried this long, then the store is down (one-line error);
    # LanceDB's own default retries a request for 3 minutes
    connect_timeout_s: float = Field(default=5.0, gt=0)
    retry_timeout_s: float = Field(default=10.0, gt=0)
    max_retries: int = Field(default=2, ge=0)
    table: str = "segments"
    window: int = Field(default=8, ge=1)  # frames per segment
    stride: int = Field(default=4, ge=1)  # frames between segment starts
    # IVF indexes train k-means on the rows present: below 256 IVF_PQ silently indexes nothing, so never lower.
    index_min_rows: int = Field(default=50_000, ge=256)
    # the vector index (components/store/index_plan.py). IVF_PQ: product-quantized partitions
    # (index_partitions, index_sub_vectors, nprobes, refine_factor); IVF_HNSW_SQ: IVF partitions,
    # each an HNSW graph over 8-bit scalar-quantized vectors (the hnsw_* keys): 1.7x less CPU per
    # unfiltered query at 1M, no gain with the success filter, 2x the build (docs/results.md). A
    # store whose index is of the other type is searched with that type's keys until upkeep rebuilds it.
    index_type: Literal["IVF_PQ", "IVF_HNSW_SQ"] = "IVF_PQ"
    # k-means iterations when an IVF index is trained (its partitions, and PQ's codebooks). LanceDB's
    # default 50 took 58 s of one ingest at the first build (74k rows) and 112 s at 1M rows; 10 took
    # 12 s and 37 s, recall@10 at 1M 0.999 -> 0.997 with the search keys below (docs/results.md)
    index_max_iterations: int = Field(default=10, ge=1)
    # --- IVF_PQ
    index_partitions: int = Field(default=256, ge=1)
    # preferred PQ sub-vectors; when it does not divide the vector dim (88 for the default sim)
    # the store takes a divisor giving 4-16 dims each, 22 for 88 (components/store/index_plan.py)
    index_sub_vectors: int = Field(default=16, ge=1)
    nprobes: int = Field(default=20, ge=1)  # IVF_PQ partitions searched per query
    refine_factor: int = Field(default=30, ge=0)  # re-rank k*factor PQ hits exactly; 0 = off
    # --- IVF_HNSW_SQ
    hnsw_partition_rows: int = Field(default=16_000, ge=256)  # partitions = rows / this
    hnsw_m: int = Field(default=16, ge=2)  # graph edges per node
    hnsw_ef_construction: int = Field(default=150, ge=1)  # build-time search breadth
    hnsw_nprobes: int = Field(default=10, ge=1)  # partitions searched per query
    hnsw_ef: int = Field(default=40, ge=1)  # per-partition search breadth (>= k is used)
    hnsw_refine_factor: int = Field(default=0, ge=0)  # re-rank k*factor SQ hits exactly; 0 = off
    metric: Literal["l2", "cosine"] = "l2"  # used to build the index AND to query it
    # --- resident index (components/store/resident.py): searches of fewer than scan_min_queries
    # queries answered from a FAISS copy of the table in memory, rebuilt when the table moves.
    # LanceDB's own query costs ~5 ms p50 / 12 ms p99 even on a 100-row table (docs/results.md)
    resident_index: bool = True
    resident_list_rows: int = Field(default=1_000, ge=1)  # IVF lists = rows / this (flat below index_min_rows)
    resident_nprobe: int = Field(default=32, ge=1)  # lists probed per query (more when a filter keeps few rows)
    resident_encoding: Literal["Flat", "SQ8"] = "Flat"  # float32 (4 B/dim) or 8-bit (1 B/dim) vectors
    # a larger table stays on LanceDB's index: Flat holds 4 x dim bytes per row (352 B at 88 dims)
    resident_max_rows: int = Field(default=5_000_000, ge=0)
    # LanceDB's vector index is built (by ingest's index upkeep) once the table has this many rows;
    # unset: index_min_rows. With the resident index on, LanceDB's index answers single queries
    # only above resident_max_rows, so a larger value skips an early build (11-69 s of one ingest
    # in a fleet-scaling cell) - but without the index's folds the table's compactions rewrote far
    # more data: a 7-day-retention store grew ~2x faster on disk (docs/results.md), so not default.
    vector_index_min_rows: int | None = Field(default=None, ge=256)
    # other processes' writes reach single queries within this many seconds (this handle's own at once)
    resident_check_s: float = Field(default=1.0, ge=0)
    # queries per LanceDB call: an indexed search materialises k * refine_factor rows per query,
    # so FERT's tens of thousands of failure windows in one call took >15 GB (96-robot study)
    search_batch_queries: int = Field(default=1024, ge=1)
    # a search of at least scan_min_queries queries (FERT's divergence and retrieval) is answered
    # exactly by one streaming pass over the table (components/store/scan.py): at 336k segments,
    # 1,164 prefiltered queries took 85 s through the index, 23 s flat in LanceDB, 21 s scanned
    scan_min_queries: int = Field(default=64, ge=1)
    scan_rows: int = Field(default=32_768, ge=1)  # rows per streamed batch
    scan_query_block: int = Field(default=1024, ge=1)  # queries scored together (block x rows floats)
    upsert_batch_rows: int = Field(default=100_000, ge=1)  # segments per merge_insert commit
    # ingest folds new rows into the vector index once this many are unindexed (searched flat till then)
    index_fold_rows: int = Field(default=50_000, ge=1)
    # upkeep retrains the vector index once the table has grown this much since its last build
    index_rebuild_growth: float = Field(default=2.0, gt=1.0)
    # upkeep/optimize prune versions older than this; tagged versions (lineage) are always kept
    # (0 keeps only the latest: only when no other process reads the table)
    retain_versions_days: float = Field(default=7, ge=0)
    # `fleetloop reproduce` needs the store version a model read: registration tags it model-v<N>
    # for the newest this-many train-task models and untags older ones (a tag stops pruning from
    # its version on, so keeping every model's would grow the store without bound)
    model_versions_kept: int = Field(default=10, ge=1)
    upkeep_cron: str = "30 3 * * *"  # when the store-upkeep flow runs once deployed (flows/upkeep.py)

    @field_validator("uri")
    @classmethod
    def _store_uri(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if value and not Path(value).is_absolute() and scheme not in STORE_URI_SCHEMES:
            raise ValueError(f"store.uri {value!r}: expected \"\" (the local store under the root), an absolute "
                             f"path or {' / '.join(f'{s}://bucket/prefix' for s in STORE_URI_SCHEMES)}")
        return value

    @model_validator(mode="after")
    def _vector_index_before_handoff(self) -> StoreConfig:
        rows = self.vector_index_min_rows
        if self.resident_index and 0 < self.resident_max_rows < (rows or 0):
            raise ValueError(
                f"store.vector_index_min_rows={rows:,} is above store.resident_max_rows={self.resident_max_rows:,}: "
                "between the two, single queries would find neither the resident copy nor LanceDB's index and "
                "scan the table; lower store.vector_index_min_rows or leave it unset (index_min_rows)")
        return self

    @property
    def vector_index_rows(self) -> int:
        """Rows from which LanceDB's vector index is built (``vector_index_min_rows``, or its default)."""
        return self.index_min_rows if self.vector_index_min_rows is None else self.vector_index_min_rows


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
    weighted ``exp(-ensemble_decay * i)`` (i = 0 the oldest; ACT's m).
    """

    kind: Literal["mlp", "moe_transformer", "chunk_transformer"] = "mlp"
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
        return self.chunk_size if self.kind == "chunk_transformer" else 1


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
    encoder: Literal["normalized_state", "learned"] = "normalized_state"  # for stores FERT builds
    learned_dim: int = Field(default=16, ge=1)
    learned_epochs: int = Field(default=20, ge=1)
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


class EvaluationConfig(Section):
    """Held-out evaluation: robots never used for collection, seeded trials."""

    trials_per_task: int = Field(default=480, ge=1)  # at least this many trials per task...
    trials_per_robot: int = Field(default=8, ge=1)  # ...spread over the held-out robots (max of both)
    confidence: float = Field(default=0.95, gt=0, lt=1)
    sample_gripper: bool = False  # False: thresholded jaw (the deployed policy); True: sampled
    # seed-level comparisons (components/evaluation/intervals.py)
    bootstrap_resamples: int = Field(default=2000, ge=100)  # hierarchical bootstrap: seeds, then robots
    power: float = Field(default=0.8, gt=0, lt=1)  # seeds_needed: chance the paired interval excludes 0

    def trials_for(self, num_robots: int) -> int:
        """Trials per robot so that every task gets at least ``trials_per_task``."""
        if num_robots < 1:
            raise ValueError("evaluation needs at least one held-out robot (fleet.num_heldout_robots)")
        return max(self.trials_per_robot, -(-self.trials_per_task // num_robots))


class RegistryConfig(Section):
    """MLflow tracking and the model registry."""

    experiment: str = "fleetloop"
    model_name: str = "fleetloop-policy"
    champion_alias: str = "champion"
    previous_alias: str = "previous"
    gate_alpha: float = 0.05
    # direct: a model that passes the offline gate becomes champion; canary: it first serves
    # runtime.canary_share of the live fleet and the fleet runtime promotes or rolls it back.
    rollout: Literal["direct", "canary"] = "direct"
    # where runs and the registry live: empty = sqlite under <root>/mlruns; else a tracking server
    # (http://host:5000, e.g. on Postgres) or a database URI. A password in it comes from the
    # environment (FLEETLOOP_REGISTRY__TRACKING_URI), never params.yaml; it is shown redacted.
    tracking_uri: str = ""
    # where new experiments keep artifacts (e.g. s3://bucket/fleetloop; keys from AWS_* and
    # MLFLOW_S3_ENDPOINT_URL): empty = <root>/mlruns/artifacts on the default store, else the
    # tracking server's own default (its --artifacts-destination / --default-artifact-root)
    artifact_uri: str = ""
    connect_timeout_s: float = Field(default=5.0, gt=0)  # a tracking store not answering by then is down at start


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


class OpsConfig(Section):
    """Orchestration: fan-out, retries, timeouts, schedules, local UIs."""

    # the engine that runs the fan-out (.map over files, episodes, robot groups): threads =
    # Prefect's thread pool (max_workers), dask = a Dask cluster (prefect-dask), ray = a Ray
    # cluster (prefect-ray). "" = the engine whose address is set, else threads (as before ray)
    engine: Literal["", "threads", "dask", "ray"] = ""
    dask_address: str = ""  # "tcp://host:8786" = a Dask cluster's scheduler
    # "" = a local Ray cluster per flow run (max_workers CPUs, started and stopped by the run);
    # "ray://host:10001" = Ray Client to a head node; "host:6379" or "auto" = join from a node
    ray_address: str = ""
    ray_object_store_mb: int = Field(default=0, ge=0)  # a local Ray cluster's object store; 0 = Ray's default (30% of RAM)
    max_workers: int = Field(default=4, ge=1)
    io_retries: int = 3
    retry_delays_s: tuple[float, ...] = (1.0, 5.0, 20.0)
    flow_timeout_s: float = 4 * 3600.0
    eval_robots_per_task: int = 4
    # the ingest flow's fan-out grain: files per read task, episodes per embed task. One task per
    # file made a 200-file batch ~20x slower than ingest_files (each Prefect task run costs tens of
    # ms of state and result writes) and put thousands of runs per batch in the UI
    ingest_files_per_task: int = Field(default=256, ge=1)
    embed_episodes_per_task: int = Field(default=256, ge=1)
    retrain_cron: str = "0 3 * * *"  # nightly at 03:00
    fleet_round_interval_s: int = 6 * 3600
    prefect_port: int = 4200
    mlflow_port: int = 5000

    @property
    def fan_out_engine(self) -> Literal["threads", "dask", "ray"]:
        """The engine in effect: ``engine``, or the one whose address is set, or the thread pool."""
        if self.engine:
            return self.engine
        return "dask" if self.dask_address else "ray" if self.ray_address else "threads"

    @model_validator(mode="after")
    def _engine_matches_addresses(self) -> OpsConfig:
        """An address the chosen engine would ignore is a mistake, not a silent fallback."""
        if self.dask_address and self.ray_address:
            raise ValueError(
                "ops.dask_address and ops.ray_address are both set: clear the one you do not mean "
                "(ops.engine picks the engine; the address says where it runs)"
            )
        engine = self.fan_out_engine
        for name, address in (("dask", self.dask_address), ("ray", self.ray_address)):
            if address and engine != name:
                raise ValueError(
                    f"ops.engine is {engine!r} but ops.{name}_address is set ({address!r}), which only "
                    f"the {name} engine reads: set ops.engine: {name}, or clear ops.{name}_address"
                )
        if engine == "dask" and not self.dask_address:
            raise ValueError(
                "ops.engine is 'dask' but ops.dask_address is empty: set it to your Dask scheduler "
                "(tcp://HOST:8786), or use ops.engine: ray (a local cluster needs no address) or threads"
            )
        if self.ray_address and not _is_ray_address(self.ray_address):
            raise ValueError(
                f"ops.ray_address {self.ray_address!r} is not a Ray address: use ray://HOST:10001 "
                "(Ray Client to a head node), HOST:6379 (the head's GCS, from a node of the cluster), "
                "auto (the cluster this node belongs to) or \"\" (a local cluster)"
            )
        return self


def _is_ray_address(address: str) -> bool:
    """``auto``, ``ray://host:port`` or a bare ``host:port`` (what ``ray.init(address=...)`` takes)."""
    if address == "auto":
        return True
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:  # a port that is not a number
        return False
    return parts.scheme in ("", "ray") and bool(parts.hostname) and port is not None


class FleetRuntimeConfig(Section):
    """FATS: the fault-tolerant asynchronous fleet runtime (components/fleet/README.md).

    Paths are relative to the root. Tokens: ``tokens`` (env ``FLEETLOOP_RUNTIME__TOKENS``, JSON
    ``{"robot-0000": "token", ...}``) and/or the token file; never in params.yaml or the repo.
    """

    host: str = "127.0.0.1"  # every service binds here; loopback unless you mean it
    inference_port: int = Field(default=8710, ge=0, le=65535)
    ingest_port: int = Field(default=8711, ge=0, le=65535)
    coordinator_port: int = Field(default=8712, ge=0, le=65535)
    # where robot agents reach the services ("" = http://host:port above); set it when robots go
    # through a load balancer or proxy (the chaos run puts a fault proxy here)
    robot_inference_url: str = ""
    robot_ingest_url: str = ""
    # inference: dynamic batching + hot swap
    batch_window_ms: float = Field(default=2.0, ge=0)  # wait this long for more requests after the first
    max_batch: int = Field(default=64, ge=1)
    alias_poll_s: float = Field(default=1.0, gt=0)  # how often the registry aliases are checked
    torch_threads: int = Field(default=1, ge=0)  # per service process; 0 = torch's default
    # timeouts and retries (robot agent)
    inference_timeout_s: float = Field(default=1.0, gt=0)  # past this the robot holds a safe action
    upload_timeout_s: float = Field(default=10.0, gt=0)
    retry_initial_s: float = Field(default=0.05, gt=0)
    retry_max_s: float = Field(default=2.0, gt=0)
    robot_episodes: int = Field(default=0, ge=0)  # episodes per robot agent; 0 = run until stopped
    # ingest
    max_upload_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    commit_window_ms: float = Field(default=20.0, ge=0)  # group commit: uploads stored together
    commit_max_episodes: int = Field(default=64, ge=1)
    # the ingest service embeds what it stored into the segment store (the ingest flow's own
    # embed + upsert, on a background thread): after each commit, and at least this often
    ingest_embeds: bool = True
    embed_interval_s: float = Field(default=5.0, gt=0)
    embed_backoff_max_s: float = Field(default=60.0, gt=0)  # a failing embed retries, doubling up to this
    upload_rate_per_s: float = Field(default=20.0, gt=0)  # per robot, sustained; over it: 429 + Retry-After
    upload_burst: int = Field(default=40, ge=1)  # per robot, uploads allowed at once before the rate applies
    quarantine_max_bytes: int = Field(default=256 * 1024 * 1024, ge=0)  # rejected bytes kept by ingest; past it not kept
    min_free_bytes: int = Field(default=64 * 1024 * 1024, ge=0)  # ingest disk reserve: below it 507 + unhealthy
    max_connections: int = Field(default=1024, ge=1)  # per service: concurrent connections before 503
    max_abs_observation: float = Field(default=1e6, gt=0)  # /v1/act: larger |obs| values are refused (422)
    # trainer
    checkpoint_every: int = Field(default=50, ge=1)  # optimizer steps between atomic checkpoints
    checkpoints_kept: int = Field(default=3, ge=1)
    steps_per_episode: int = Field(default=4, ge=1)  # replay ratio: steps per newly consumed episode
    trainer_batch_size: int = Field(default=64, ge=1)
    trainer_success_only: bool = True  # filtered BC on successful episodes (else all, uninterrupted)
    trainer_poll_s: float = Field(default=0.5, gt=0)
    # train.method fert / fert_uniform: the trainer's training set is rebuilt (divergence,
    # retrieval) from a pinned store version once the store has embedded this many more episodes
    trainer_rebuild_episodes: int = Field(default=100, ge=1)
    # trainer -> candidates (components/fleet/shipping.py): a checkpoint becomes a candidate every
    # N optimizer steps or M seconds since the last one, whichever comes first (0 turns that
    # trigger off; both 0 = the trainer never ships)
    candidate_every_steps: int = Field(default=1000, ge=0)
    candidate_every_s: float = Field(default=600.0, ge=0)
    candidate_retry_s: float = Field(default=30.0, gt=0)  # after a failed ship, or while a canary is live
    # coordinator: leases, restarts, staleness
    heartbeat_s: float = Field(default=0.5, gt=0)
    lease_s: float = Field(default=5.0, gt=0)  # no heartbeat for this long = hung: killed + restarted
    # ... unless it used CPU since its last beat (starved by a busy host, not hung): then it gets
    # up to this many leases before it is killed, so an overloaded host is not made worse by
    # restarting every member at once
    starved_lease_factor: float = Field(default=4.0, ge=1.0)
    starved_min_cpu_s: float = Field(default=0.05, ge=0)  # CPU used since the last beat that counts as progress
    startup_grace_s: float = Field(default=60.0, gt=0)  # a fresh process gets this long to first heartbeat
    max_staleness_s: float = Field(default=10.0, gt=0)  # served policy may lag the registry alias this long
    restart_backoff_s: float = Field(default=0.5, ge=0)  # first restart delay; doubles per failure in a row
    restart_backoff_max_s: float = Field(default=30.0, ge=0)  # the doubling stops here
    stop_grace_s: float = Field(default=5.0, ge=0)  # SIGTERM, then SIGKILL after this
    # canary rollout
    canary_share: float = Field(default=0.25, ge=0, le=1)  # fraction of robots served the canary
    canary_min_episodes: int = Field(default=30, ge=1)  # per arm before the gate may decide
    canary_max_episodes: int = Field(default=200, ge=1)  # canary arm budget: not better by then = rollback
    canary_check_s: float = Field(default=5.0, gt=0)
    canary_alias: str = "canary"
    # where things live, relative to the root
    runtime_dir: str = "fleet-runtime"  # spool/, state/, checkpoints/, logs/; self-ignoring for git
    token_file: str = "fleet-runtime/secrets/tokens.json"
    tokens: SecretStr = SecretStr("")  # JSON robot -> token; from the environment only


class DemoConfig(Section):
    """The bootstrap + closed-loop rounds that `make demo` runs."""

    expert_robots: int = 4
    expert_episodes_per_robot: int = 30
    rounds: int = 3


class Paths(Section):
    """Every on-disk location, derived from one root so two roots never share state."""

    root: Path

    @property
    def datasets(self) -> Path:
        return self.root / "datasets"

    @property
    def episodes(self) -> Path:
        return self.datasets / "episodes"

    @property
    def incoming(self) -> Path:
        return self.datasets / "incoming"

    @property
    def quarantine(self) -> Path:
        return self.datasets / "quarantine"

    @property
    def store(self) -> Path:
        return self.datasets / "segments.lance"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def prefect_home(self) -> Path:
        return self.root / ".prefect"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"


class _YamlSource(PydanticBaseSettingsSource):
    """Reads params.yaml from the root (FLEETLOOP_ROOT or the repository)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = params_path()
        if not path.exists():
            return {}
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of sections at the top level")
        _refuse_passwords(data, path)
        return data


# (section, field) of the store URIs that may carry user:password@: refused in params.yaml, redacted when shown
SECRET_URI_FIELDS = (("registry", "tracking_uri"), ("registry", "artifact_uri"), ("store", "uri"))


def _refuse_passwords(data: dict[str, Any], path: Path) -> None:
    """params.yaml is committed: a store URI with a password in it is an error (secrets come from env)."""
    for section, key in SECRET_URI_FIELDS:
        values = data.get(section) or {}
        uri = values.get(key) if isinstance(values, dict) else None
        if isinstance(uri, str) and urlsplit(uri).password:
            raise ValueError(
                f"{path}: {section}.{key} holds a password; remove it from the file and set the URI in "
                f"FLEETLOOP_{section.upper()}__{key.upper()} (or the store's own secret: MLFLOW_TRACKING_PASSWORD, "
                "~/.pgpass, ~/.aws/credentials)"
            )


def params_path() -> Path:
    root = Path(os.environ.get("FLEETLOOP_ROOT", REPO_ROOT))
    candidate = root / PARAMS_FILE
    return candidate if candidate.exists() else REPO_ROOT / PARAMS_FILE


class Settings(BaseSettings):
    """The whole configuration. ``Settings()`` reads params.yaml + environment."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETLOOP_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    root: Path = Field(default=REPO_ROOT)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    sim: SimConfig = SimConfig()
    fleet: FleetConfig = FleetConfig()
    episodes: EpisodesConfig = EpisodesConfig()
    store: StoreConfig = StoreConfig()
    policy: PolicyConfig = PolicyConfig()
    train: TrainConfig = TrainConfig()
    shuffle: ShuffleConfig = ShuffleConfig()
    distributed: DistributedConfig = DistributedConfig()
    fert: FertConfig = FertConfig()
    explain: ExplainConfig = ExplainConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    registry: RegistryConfig = RegistryConfig()
    demo: DemoConfig = DemoConfig()
    ops: OpsConfig = OpsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    runtime: FleetRuntimeConfig = FleetRuntimeConfig()

    @model_validator(mode="after")
    def _ranks_split_over_nodes(self) -> Settings:
        self.distributed.nproc_per_node(self.train.world_size)  # raises, naming both fields
        return self

    @field_validator("root")
    @classmethod
    def _absolute_root(cls, value: Path) -> Path:
        return Path(value).expanduser().resolve()

    @property
    def paths(self) -> Paths:
        return Paths(root=self.root)

    def known_robots(self) -> set[str]:
        """Every robot id ingest accepts: the collecting fleet, held-out robots and extras."""
        max_fleet = max(self.fleet.num_robots, 96)
        return set(self.fleet.robot_ids(max_fleet)) | set(self.fleet.heldout_ids()) | set(
            self.fleet.extra_robots
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))


def load_settings(**overrides: Any) -> Settings:
    """Settings from params.yaml + env, with keyword overrides taking precedence."""
    return Settings(**overrides)
