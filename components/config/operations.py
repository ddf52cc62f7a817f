"""Running it: the MLflow registry and gate (``registry``), Prefect operations and fan-out (``ops``)
and the FATS fleet runtime (``runtime``)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, model_validator

from components.config.base import Section


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
    torch_threads: int = Field(default=1, ge=0)  # per service process and for the loop's rollouts (PolicyActor); 0 = torch's default
    # inference: after start-up, move every object built so far out of the garbage collector's
    # generations (gc.freeze), so a full collection no longer walks FastAPI, MLflow and torch:
    # its ~250 ms pauses were the service's longest stalls; p99 at 96 camera robots 2.9x lower with it
    # (benchmarks/vision_inference.py --ab gc_freeze)
    gc_freeze: bool = True
    # every service's event loop and HTTP parser: auto = uvloop and httptools (C, installed with the
    # project; at 96 camera robots the inference loop was busy 14% less and the service used 0.88
    # cores vs 0.90, but p99 did not move measurably: benchmarks/vision_inference.py --ab stack);
    # asyncio / h11 = the pure-Python ones, an operator's fallback
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    http_parser: Literal["auto", "httptools", "h11"] = "auto"
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
