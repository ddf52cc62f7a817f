"""The coordinator: starts every fleet process, holds their leases, restarts what dies.

    start: ingest, inference, trainer, one robot agent per robot id (each its own OS process)
    every heartbeat_s (the supervisor thread; policy + canary on a second one, so a slow registry
    never delays a restart):
      exited?           -> restart after a backoff: restart_backoff_s * 2^(failures in a row),
                           capped at restart_backoff_max_s; a member that beats (or answers
                           /healthz) after its start resets the count. A finite robot that
                           exited 0 is done, not dead
      lease expired?    -> robots/trainer renew theirs by POST /v1/heartbeat; silent longer
                           than lease_s (startup_grace_s before the first beat) = hung: SIGKILL
                           + restart. A member that used CPU since its last beat is starved (a
                           busy host, a slow coordinator), not hung: it gets up to
                           starved_lease_factor leases, so overload never turns into a restart storm
      service unhealthy -> /healthz failing for lease_s: SIGKILL + restart
      policy staleness  -> the version inference serves must match the registry alias within
                           max_staleness_s, else inference is restarted (it reloads on start)
      canary            -> every canary_check_s, CanaryRollout.evaluate() (promote / roll back)
      status            -> state/status.json (what `fleetloop fleet status` prints), with the
                           version serving each robot (``serving``, from its heartbeats)
    SIGTERM: stop every child (SIGTERM, then SIGKILL after stop_grace_s), then exit (a registry
             read in flight is not waited for; a canary decision being written is).
    SIGKILL: every member watches it (components/fleet/identity.py: watch_parent) and stops.

One coordinator per root: it holds an exclusive lock on ``state/coordinator.lock`` for its
lifetime (the kernel drops it when the process dies, however it dies) and records its identity
(pid, start time, command line) in ``state/coordinator.pid``, removed by the graceful shutdown.
``state/status.json`` records every member's identity so `fleet down` can verify before it signals.

HTTP (on runtime.coordinator_port): POST /v1/heartbeat (a robot may renew only its own lease;
the service token renews any), GET /v1/status (service token), GET /healthz.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import subprocess
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from components.config import Settings
from components.fleet.auth import ROBOT, SERVICE, Principal, TokenBook, read_token_file
from components.fleet.clients import HEARTBEAT_PATH, STATUS_PATH, base_url
from components.fleet.health import HealthProblem
from components.fleet.http_server import (
    NO_API_DOCS,
    add_health,
    auth_dependency,
    http_error,
    read_body_limited,
    serve,
)
from components.fleet.identity import (
    ProcessIdentity,
    cpu_seconds,
    remove_pid_file_if_mine,
    write_pid_file,
)
from components.fleet.layout import RuntimeLayout
from components.fleet.processes import (
    ProcessSpec,
    kill_pid,
    start_process,
    stop_process,
    write_settings,
)
from components.fsio import atomic_write_bytes

log = logging.getLogger(__name__)

SERVICES = ("ingest", "inference")
LEASED = ("robot", "trainer")
MAX_HEARTBEAT_BYTES = 16 * 1024
PROBE_TIMEOUT_S = 1.0
EVENTS_KEPT = 32  # per member, in memory: the newest start/stop lines
STATUS_DELAYS = 8  # restart delays per member in /v1/status
THREAD_STOP_S = 10.0  # on stop: how long the supervisor (or a canary decision being written) is waited for


@dataclass
class Member:
    """One supervised process."""

    spec: ProcessSpec
    proc: subprocess.Popen | None = None
    started: float = 0.0
    last_beat: float | None = None
    unhealthy_since: float | None = None
    restarts: int = 0
    done: bool = False
    last_exit: int | None = None
    info: dict = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    identity: ProcessIdentity | None = None
    failures: int = 0  # restarts in a row without a heartbeat / healthy probe in between
    restart_at: float | None = None  # a restart is scheduled for this monotonic time
    backoff_s: float = 0.0  # the last restart delay chosen
    delays: list[float] = field(default_factory=list)  # restart delays chosen, newest last (bounded)
    cpu_at_beat: float | None = None  # its CPU seconds at the last beat (or start)
    starved: int = 0  # lease checks it survived as starved, not hung (this run)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def lease_verdict(age_s: float, limit_s: float, cpu_used_s: float | None, factor: float, min_cpu_s: float) -> str:
    """``ok`` within the lease; ``starved`` past it but still using CPU (up to ``factor`` leases);
    else ``hung``. ``cpu_used_s``: CPU the process used since its last beat (None: unknown)."""
    if age_s <= limit_s:
        return "ok"
    if cpu_used_s is not None and cpu_used_s >= min_cpu_s and age_s <= limit_s * factor:
        return "starved"
    return "hung"


def restart_delay(failures: int, initial_s: float, max_s: float) -> float:
    """Delay before the next restart of a member that failed ``failures`` times in a row."""
    return min(max_s, initial_s * 2**failures)


def backoff_delays(failures: int, initial_s: float, max_s: float) -> list[float]:
    """The delays a member that failed ``failures`` times in a row, never beating between, waited."""
    return [restart_delay(n, initial_s, max_s) for n in range(failures)]


class Coordinator:
    """Supervises one root's fleet (thread-safe: the HTTP handlers and the supervisor share it)."""

    def __init__(self, settings: Settings, finite: bool | None = None) -> None:
        self.settings = settings
        self.cfg = settings.runtime
        self.layout = RuntimeLayout.of(settings).ensure()
        self.settings_file = write_settings(settings)
        self.finite = self.cfg.robot_episodes > 0 if finite is None else finite
        specs = [ProcessSpec(role, role) for role in ("ingest", "inference", "trainer")]
        # a revoked robot is not started (its agent would only collect 403s and restarts)
        self.revoked = read_token_file(self.layout.token_file).revoked_robots
        specs += [ProcessSpec("robot", robot) for robot in settings.fleet.robot_ids() if robot not in self.revoked]
        self.members = {spec.name: Member(spec) for spec in specs}
        self.lock = threading.Lock()
        self.stale_since: float | None = None
        self.served: dict[str, int] = {}
        self.aliases: dict[str, int] = {}
        self.canary: dict = {}
        self._last_canary = 0.0
        self._last_alias_poll = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._policy_thread = threading.Thread(target=self._run_policy, name="policy", daemon=True)
        self._registry_write = threading.Lock()  # held by the policy thread while a canary decision is written
        self._registry = None
        self._rollout = None

    # ------------------------------------------------------------------ processes
    def _start(self, member: Member, reason: str) -> None:
        member.proc = start_process(member.spec, self.settings_file, self.layout.logs, parent_watch=True)
        member.identity = ProcessIdentity.of(member.proc.pid)
        member.started = time.monotonic()
        member.last_beat = None
        member.cpu_at_beat = cpu_seconds(member.proc.pid)
        member.unhealthy_since = None
        member.restart_at = None
        del member.events[:-EVENTS_KEPT]
        member.events.append(f"{time.time():.3f} start ({reason}) pid {member.proc.pid}")
        log.info("started %s pid %d (%s)", member.spec.name, member.proc.pid, reason)

    def _restart(self, member: Member, reason: str, kill: bool, now: float | None = None) -> None:
        """Kill (if asked) now; start again after the backoff (exponential in failures, capped)."""
        if kill and member.proc is not None and member.proc.poll() is None:
            kill_pid(member.proc.pid)
            member.proc.wait()
        now = time.monotonic() if now is None else now
        member.backoff_s = restart_delay(member.failures, self.cfg.restart_backoff_s, self.cfg.restart_backoff_max_s)
        member.failures += 1
        member.restart_at = now + member.backoff_s
        member.delays = [*member.delays[-EVENTS_KEPT + 1 :], member.backoff_s]
        member.events.append(f"{time.time():.3f} down ({reason}); restart in {member.backoff_s:.2f}s")
        log.warning("restarting %s in %.2fs (failure %d in a row): %s", member.spec.name, member.backoff_s, member.failures, reason)

    def _beat(self, member: Member, now: float) -> None:
        """The member does its job: its lease is renewed and its failure streak ends."""
        member.last_beat = now
        member.failures = 0
        if member.proc is not None:
            member.cpu_at_beat = cpu_seconds(member.proc.pid)

    def start(self) -> None:
        with self.lock:
            for member in self.members.values():
                self._start(member, "fleet up")
        self.write_status()  # every member's identity is on disk before anything can go wrong
        self._thread.start()
        self._policy_thread.start()

    def stop(self) -> None:
        """Stop supervising, then every child (SIGTERM, SIGKILL after the grace period).

        The supervisor (it starts processes) is waited for. The policy thread is waited for only
        while it writes a canary decision to the registry: its reads (the first one imports the
        registry client, seconds on a busy host) are abandoned, and it starts no write once
        stopping began."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=THREAD_STOP_S)
        writing_done = self._registry_write.acquire(timeout=THREAD_STOP_S)
        try:
            with self.lock:
                for member in self.members.values():
                    if member.proc is not None and member.proc.poll() is None:
                        member.proc.terminate()
                for member in self.members.values():
                    if member.proc is not None:
                        stop_process(member.proc, self.cfg.stop_grace_s)
            self.write_status()
        finally:
            if writing_done:
                self._registry_write.release()

    # ------------------------------------------------------------------ leases
    def heartbeat(self, name: str, principal: Principal, info: dict) -> None:
        if principal.role == ROBOT and principal.name != name:
            raise http_error(403, "name", f"robot {principal.name!r} may renew only its own lease", "send your own robot id")
        with self.lock:
            member = self.members.get(name)
            if member is None:
                raise http_error(404, "name", f"{name!r} is not a member of this fleet", "check the robot id")
            self._beat(member, time.monotonic())
            member.info = info

    @staticmethod
    def _cpu_since_beat(member: Member) -> float | None:
        now = cpu_seconds(member.proc.pid) if member.proc is not None else None
        return None if now is None or member.cpu_at_beat is None else now - member.cpu_at_beat

    def _probe(self, member: Member) -> bool:
        """True while the service answers /healthz as able to work, or as degraded in a way a
        restart cannot fix (disk full: the reason goes to its info, it is not restarted)."""
        port = self.cfg.ingest_port if member.spec.role == "ingest" else self.cfg.inference_port
        try:
            response = httpx.get(f"{base_url(self.cfg.host, port)}/healthz", timeout=PROBE_TIMEOUT_S)
            body = response.json()
        except (httpx.HTTPError, ValueError):
            return False
        if response.status_code != 200:
            degraded = isinstance(body, dict) and body.get("restart") is False
            member.info = {"degraded": str(body.get("reason", ""))} if degraded else member.info
            return degraded
        member.info = {}
        if member.spec.role == "inference":
            self.served = {k: int(v) for k, v in body.get("served", {}).items()}
        return True

    def check(self, member: Member, now: float) -> None:
        """One member's liveness: exit, lease or health; restart when needed."""
        if member.done or member.proc is None:
            return
        if member.restart_at is not None:
            if now >= member.restart_at:
                member.restarts += 1
                self._start(member, f"restart after {member.backoff_s:.2f}s backoff")
            return
        code = member.proc.poll()
        if code is not None:
            member.last_exit = code
            if member.spec.role == "robot" and code == 0 and self.finite:
                member.done = True
                member.events.append(f"{time.time():.3f} done")
                log.info("%s finished its episodes", member.spec.name)
                return
            self._restart(member, f"exited with code {code}", kill=False, now=now)
            return
        age = now - (member.last_beat if member.last_beat is not None else member.started)
        if member.spec.role in LEASED:
            limit = self.cfg.lease_s if member.last_beat is not None else self.cfg.startup_grace_s
            verdict = lease_verdict(age, limit, self._cpu_since_beat(member), self.cfg.starved_lease_factor,
                                    self.cfg.starved_min_cpu_s)
            if verdict == "hung":
                self._restart(member, f"lease expired ({age:.1f}s without a heartbeat)", kill=True, now=now)
            elif verdict == "starved":
                member.starved += 1
                if member.starved == 1 or member.starved % 20 == 0:
                    log.warning("%s: %.1fs without a heartbeat but still using CPU: starved, not hung (%d checks)",
                                member.spec.name, age, member.starved)
            return
        if self._probe(member):
            self._beat(member, now)
            member.unhealthy_since = None
            return
        if now - member.started < self.cfg.startup_grace_s and member.last_beat is None:
            return  # still starting
        member.unhealthy_since = member.unhealthy_since or now
        if now - member.unhealthy_since > self.cfg.lease_s:
            self._restart(member, "health check failing", kill=True, now=now)

    # ------------------------------------------------------------------ policy
    def _registry_handle(self):
        if self._registry is None:
            from components.episodes.dataset import EpisodeDataset
            from components.registry.canary import CanaryRollout
            from components.registry.model_registry import PolicyRegistry

            self._registry = PolicyRegistry(self.settings.paths.mlruns, self.settings.registry)
            dataset = EpisodeDataset(self.settings.paths.episodes, self.settings.episodes)
            self._rollout = CanaryRollout(self._registry, dataset, self.cfg)
        return self._registry

    def check_policy(self, now: float) -> None:
        """Bound staleness (served vs registry) and drive the canary."""
        registry = self._registry_handle()
        if now - self._last_alias_poll >= self.cfg.alias_poll_s:
            self.aliases = registry.aliases()
            self._last_alias_poll = now
        watched = (self.settings.registry.champion_alias, self.cfg.canary_alias)
        wanted = {a: v for a, v in self.aliases.items() if a in watched}
        inference = self.members["inference"]
        if inference.alive() and self.served != wanted and inference.last_beat is not None:
            self.stale_since = self.stale_since or now
            if now - self.stale_since > self.cfg.max_staleness_s:
                with self.lock:
                    if self._stop.is_set():
                        return  # stopping: every member is being stopped
                    self._restart(inference, f"serving {self.served}, registry says {wanted}: staleness bound", kill=True, now=now)
                self.stale_since = None
        else:
            self.stale_since = None
        if self._rollout is not None and now - self._last_canary > self.cfg.canary_check_s:
            self._last_canary = now
            with self._registry_write:
                if self._stop.is_set():
                    return  # stopping: no new decision
                if self._rollout.live() is not None:
                    decision = self._rollout.evaluate()
                    self.canary = {"action": decision.action, "reason": decision.reason, "time": time.time()}

    # ------------------------------------------------------------------ loop + status
    def tick(self) -> None:
        """Liveness of every member, then status.json (never waits on the registry)."""
        now = time.monotonic()
        with self.lock:
            for member in self.members.values():
                self.check(member, now)
        self.write_status()

    def policy_tick(self) -> None:
        """Staleness + canary: on its own thread, since MLflow calls can take seconds."""
        try:
            self.check_policy(time.monotonic())
        except Exception:  # noqa: BLE001 - a registry hiccup must not stop supervision
            log.exception("policy check failed; retrying next tick")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - supervision must outlive any one bad tick
                log.exception("supervisor tick failed; retrying next tick")
            self._stop.wait(self.cfg.heartbeat_s)

    def _run_policy(self) -> None:
        while not self._stop.is_set():
            self.policy_tick()
            self._stop.wait(self.cfg.heartbeat_s)

    def problem(self) -> HealthProblem | None:
        """Unhealthy when a supervising thread died (it would supervise nothing)."""
        for thread in (self._thread, self._policy_thread):
            if thread.ident is not None and not thread.is_alive() and not self._stop.is_set():
                return HealthProblem(f"the {thread.name} thread is dead", restart=True)
        return None

    def status(self) -> dict:
        now = time.monotonic()
        with self.lock:
            members = {
                name: {
                    "role": m.spec.role,
                    "pid": m.pid,
                    "identity": m.identity.to_dict() if m.identity is not None else None,
                    "alive": m.alive(),
                    "failures": m.failures,
                    "restart_in_s": None if m.restart_at is None else round(max(0.0, m.restart_at - now), 3),
                    "restart_delays": m.delays[-STATUS_DELAYS:],  # newest last: a storm shows as no doubling
                    "done": m.done,
                    "restarts": m.restarts,
                    "starved_checks": m.starved,  # lease checks passed as starved (using CPU), not hung
                    "last_exit": m.last_exit,
                    "heartbeat_age_s": None if m.last_beat is None else round(now - m.last_beat, 3),
                    "info": m.info,
                }
                for name, m in self.members.items()
            }
        robots = [m for m in members.values() if m["role"] == "robot"]
        return {
            "coordinator_pid": os.getpid(),
            "members": members,
            "robots_done": sum(r["done"] for r in robots),
            "robots": len(robots),
            "revoked": list(self.revoked),
            "served": self.served,
            # per robot, the version that answered its latest action (from its heartbeat)
            "serving": {name: m["info"].get("serving") for name, m in members.items() if m["role"] == "robot"},
            "aliases": self.aliases,
            "canary": self.canary,
            "time": time.time(),
        }

    def write_status(self) -> None:
        atomic_write_bytes(self.layout.status_file, json.dumps(self.status(), indent=2).encode())


def create_coordinator_app(coordinator: Coordinator, book: TokenBook) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        coordinator.start()
        yield
        # here, not in a `finally` around serve(): uvicorn re-raises SIGTERM after this shutdown
        await asyncio.to_thread(coordinator.stop)
        remove_pid_file_if_mine(coordinator.layout.coordinator_pid_file)

    app = FastAPI(title="fleetloop coordinator", lifespan=lifespan, **NO_API_DOCS)
    member_auth = auth_dependency(book, [ROBOT, SERVICE])
    service_only = auth_dependency(book, [SERVICE])
    add_health(app, lambda: {"service": "coordinator"}, coordinator.problem)

    @app.post(HEARTBEAT_PATH)
    async def heartbeat(request: Request, principal: Principal = Depends(member_auth)) -> JSONResponse:
        try:
            body = json.loads(await read_body_limited(request, MAX_HEARTBEAT_BYTES))
            name, info = str(body["name"]), dict(body.get("info") or {})
        except (ValueError, KeyError, TypeError):
            raise http_error(422, "body", "expected JSON {name, info}", "send {\"name\": <robot id>, \"info\": {}}") from None
        coordinator.heartbeat(name, principal, info)
        return JSONResponse({"ok": True, "lease_s": coordinator.cfg.lease_s})

    @app.get(STATUS_PATH)
    async def status(principal: Principal = Depends(service_only)) -> JSONResponse:
        return JSONResponse(coordinator.status())

    return app


class CoordinatorAlreadyRunning(RuntimeError):
    """Another coordinator holds this root's lock."""


def hold_root_lock(layout: RuntimeLayout) -> int:
    """Take ``state/coordinator.lock`` for this process's lifetime (the fd stays open), or raise."""
    layout.state.mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.coordinator_lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CoordinatorAlreadyRunning(
            f"{layout.coordinator_lock_file} is held: a coordinator already runs for {layout.root}; "
            "`fleetloop fleet status` shows it, `fleetloop fleet down` stops it"
        ) from None
    return fd


def run_coordinator(settings: Settings, book: TokenBook) -> None:
    """The coordinator process: supervise the fleet until SIGTERM/SIGINT (one per root)."""
    layout = RuntimeLayout.of(settings).ensure()
    hold_root_lock(layout)  # before any member starts: never two sets on one root
    coordinator = Coordinator(settings)
    write_pid_file(layout.coordinator_pid_file)
    try:
        serve(create_coordinator_app(coordinator, book), settings.runtime, settings.runtime.coordinator_port)
    finally:  # reached on SIGINT or a start-up error (SIGTERM is handled by the lifespan)
        coordinator.stop()
        remove_pid_file_if_mine(layout.coordinator_pid_file)
