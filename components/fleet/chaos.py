"""Chaos run: a whole fleet on loopback under a seeded, logged fault schedule, then an audit.

    setup   tokens, a champion, two fault proxies (robots reach inference and ingest through
            them: runtime.robot_*_url), the disk reserve set just under today's free space,
            then the coordinator, as `fleet up` starts it (every member its own process;
            robots run episodes until stopped)
    faults  for ``duration_s`` (at least one full round): a seeded schedule of rounds, each a
            permutation of every kind, at random gaps:
              robot | inference | ingest | trainer   SIGKILL that member (the coordinator restarts it)
              coordinator   SIGKILL; its members stop by themselves; the runner then does what an
                            operator's `fleet up` does: stops any member that outlived it, starts
                            a new coordinator (one set per root, so nothing is stored twice)
              drop | delay  both proxies close / slow every connection for ``window_s``
              reset         both proxies abort every open connection with an RST (waits until
                            there is one: during a fleet restart or a drop there is none)
              disk_full     a filler file takes the dataset's filesystem below runtime.min_free_bytes
                            for ``window_s`` (ingest: 507 + degraded /healthz)
              disk_quota    the ingest process's RLIMIT_FSIZE drops to 0 for ``window_s``: its
                            writes really fail (EFBIG), as on a full disk or quota
              revoke        a running robot's token is revoked, then re-issued ``window_s`` after
                            its lease lapsed (lease_s + window_s: `fleet tokens --readmit`)
    drain   every fault healed; `fleet down`, then `fleet up` with robots that run no new
            episode (``robot_episodes`` = 1) and exit once their spool is uploaded
    audit   from disk only, every robot's ledger against the dataset:
              finished   = every episode any robot spooled (ledger + pending + rejected)
              stored     = finished episodes found in the dataset; duplicated = ids stored more than once
              lost       = finished but not stored; corrupted = stored content hash != finished
                           hash, or a stored episode that no longer validates
              latency    = spooled -> acknowledged as stored, per ledger line
              trainer    = resumes (from which checkpoint step), the loss curve around each

Everything is bounded (a fixed schedule, ``timeout_s`` on every wait) and every process started
is stopped, and checked gone, before the report is returned.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from components.config import FleetConfig, Settings
from components.fleet.auth import (
    SERVICE,
    issue_tokens,
    read_token_file,
    revoke_robot,
    token_for,
)
from components.fleet.chaos_audit import (
    RATE_WINDOW_S,
    ChaosReport,
    Fault,
    Revocation,
    ScheduledFault,
    TimelinePoint,
    audit,
    max_in_window,
    trainer_status,
)
from components.fleet.clients import CoordinatorClient
from components.fleet.fault_proxy import DELAY, DROP, PASS, FaultProxy
from components.fleet.identity import (
    ProcessIdentity,
    fleet_processes,
    stop_verified,
    wait_gone,
)
from components.fleet.layout import RuntimeLayout
from components.fleet.local import register_policy, service_url, with_free_ports
from components.fleet.processes import (
    ProcessSpec,
    kill_pid,
    start_process,
    stop_process,
    wait_healthy,
    write_settings,
)

log = logging.getLogger(__name__)

KILLS = ("robot", "inference", "ingest", "trainer", "coordinator")
NETWORK = ("drop", "delay", "reset")
DISK = ("disk_full", "disk_quota")
FAULT_KINDS = (*KILLS, *NETWORK, *DISK, "revoke")
POLL_S = 0.25
DEFER_S = 1.0  # a fault that cannot happen yet (no checkpoint, no running robot) is retried this much later
DRAIN_EPISODES = 1  # robots finish at most their first episode, upload their spool, exit 0
FILLER_NAME = ".chaos-disk-filler"


@dataclass(frozen=True)
class ChaosPlan:
    robots: int = 4
    duration_s: float = 60.0  # the fault phase (at least one full round of every kind)
    kinds: tuple[str, ...] = FAULT_KINDS  # each round is a seeded permutation of these
    extra_robot_kills: int = 1  # per round, on top of the one in ``kinds``
    min_gap_s: float = 1.0
    max_gap_s: float = 2.5
    window_s: float = 5.0  # how long drop / delay / disk_full / disk_quota / revoke last
    net_delay_s: float = 0.4  # per forwarded chunk while ``delay`` lasts
    disk_headroom_bytes: int = 2 * 1024**3  # min_free_bytes = free space at start minus this
    sample_s: float = 2.0  # timeline resolution
    seed: int = 0
    timeout_s: float = 300.0  # bound on every wait (start, drain, restarts)


def chaos_settings(base: Settings, plan: ChaosPlan, **runtime: object) -> Settings:
    """A small, fast fleet on free loopback ports (short episodes, frequent checkpoints)."""
    defaults = dict(
        robot_episodes=0, checkpoint_every=10, steps_per_episode=4, trainer_batch_size=32,
        trainer_rebuild_episodes=50, heartbeat_s=0.25, lease_s=4.0, startup_grace_s=90.0, alias_poll_s=0.5,
        inference_timeout_s=1.0, retry_initial_s=0.05, retry_max_s=0.5, stop_grace_s=3.0, canary_share=0.0,
    )
    defaults.update(runtime)
    settings = with_free_ports(base, **defaults)
    fleet = FleetConfig(**{**base.fleet.model_dump(), "num_robots": plan.robots})
    return settings.model_copy(update={"fleet": fleet})


def fault_schedule(plan: ChaosPlan) -> list[ScheduledFault]:
    """Seeded rounds (each every kind once, plus extra robot kills, shuffled) at random gaps: the
    first round always completes; later ones only while within ``duration_s``."""
    rng = np.random.default_rng(plan.seed)
    faults: list[ScheduledFault] = []
    at = 0.0
    while True:
        kinds = [*plan.kinds, *(["robot"] * plan.extra_robot_kills)]
        for kind in (kinds[i] for i in rng.permutation(len(kinds))):
            at += float(rng.uniform(plan.min_gap_s, plan.max_gap_s))
            if at > plan.duration_s and len(faults) >= len(kinds):
                return faults
            faults.append(ScheduledFault(round(at, 2), str(kind)))


def ensure_champion(settings: Settings) -> int:
    """A champion for the fleet to run: the registry's, else a freshly initialized policy."""
    import torch

    from components.policy.factory import make_policy
    from components.registry.model_registry import PolicyRegistry
    from components.sim.factory import action_dim, observation_dim

    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    champion = registry.champion()
    if champion is not None:
        return champion.version
    torch.manual_seed(settings.seed)
    policy = make_policy(observation_dim(settings.sim), action_dim(settings.sim), settings.policy)
    version = register_policy(settings, policy, run_name="chaos-initial")
    registry.set_champion(version)
    return version


class ChaosRun:
    """One chaos run: ``run()`` = setup, fault phase, heal, drain, stop, audit."""

    def __init__(self, settings: Settings, plan: ChaosPlan, progress: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        self.settings = settings
        self.layout = RuntimeLayout.of(settings).ensure()
        self.progress = progress or (lambda line: log.info("%s", line))
        self.report = ChaosReport(plan.robots, plan.duration_s, plan.seed)
        self.rng = np.random.default_rng([plan.seed, 1])  # which robot: apart from the schedule's stream
        self.grace = settings.runtime.stop_grace_s
        self.proxies: dict[str, FaultProxy] = {}
        self.coordinator = None
        self.client: CoordinatorClient | None = None
        self.carried: dict[str, int] = {}  # restarts counted by coordinators since killed (+1: the next one started them)
        self.coordinator_restarts = 0
        self.heals: list[tuple[float, str, Callable[[], None]]] = []  # (when, kind, undo)
        self.robot_counts: dict[str, tuple[int, int]] = {}  # robot -> (finished, stored), newest known
        self.restart_series: dict[str, list[tuple[float, int]]] = {}
        self.fleet_restarts: list[tuple[float, int]] = []
        self.start = self.fleet_up = self.deadline = 0.0
        self.headroom = plan.disk_headroom_bytes
        self._next_sample = self._next_progress = 0.0

    # ------------------------------------------------------------------ run
    def run(self) -> ChaosReport:
        self.start = time.monotonic()
        try:
            self._setup()
            self._fault_phase()
            self._heal(every=True)
            self._wait_recovered()
            self._drain()
        finally:
            self._teardown()
        self.report.seconds = round(time.monotonic() - self.start, 1)
        self._summarize()
        return audit(self.settings, self.report)

    def _t(self) -> float:
        return round(time.monotonic() - self.fleet_up, 2)

    def _setup(self) -> None:
        cfg = self.settings.runtime
        issue_tokens(self.layout.token_file, self.settings.fleet.robot_ids())
        ensure_champion(self.settings)
        for role, port in (("inference", cfg.inference_port), ("ingest", cfg.ingest_port)):
            self.proxies[role] = FaultProxy(cfg.host, port, cfg.host).start()
        free = shutil.disk_usage(self._dataset_fs()).free
        # the reserve sits ``headroom`` below today's free space, so a filler of ~1.5x headroom
        # (never more than half the free space) takes the disk below it, whatever the disk's size
        self.headroom = min(self.plan.disk_headroom_bytes, free // 4)
        runtime = cfg.model_copy(update={
            "robot_inference_url": self.proxies["inference"].url, "robot_ingest_url": self.proxies["ingest"].url,
            "min_free_bytes": max(cfg.min_free_bytes, free - self.headroom),
        })
        self.settings = self.settings.model_copy(update={"runtime": runtime})
        self.settings_file = write_settings(self.settings)
        self.service_token = token_for(SERVICE, self.layout.token_file, cfg.tokens)
        self.client = CoordinatorClient(service_url(self.settings, "coordinator"), self.service_token, 5.0)
        self.deadline = time.monotonic() + self.plan.timeout_s
        self._start_coordinator()
        while self._stored() < self.plan.robots and time.monotonic() < self.deadline:
            time.sleep(POLL_S)  # the fleet is up and uploading before the first fault
        self.fleet_up = time.monotonic()
        self.progress(f"fleet up after {self.fleet_up - self.start:.0f}s: {self.plan.robots} robots; faults for {self.plan.duration_s:.0f}s")

    def _dataset_fs(self) -> Path:
        self.settings.paths.datasets.mkdir(parents=True, exist_ok=True)
        return self.settings.paths.datasets

    def _start_coordinator(self) -> None:
        url = service_url(self.settings, "coordinator")
        proc = start_process(ProcessSpec("coordinator", "coordinator"), self.settings_file, self.layout.logs)
        if not wait_healthy(url, self.plan.timeout_s, proc):
            stop_process(proc, self.grace)
            raise RuntimeError(f"coordinator did not start; see {self.layout.logs / 'coordinator.log'}")
        self.coordinator = proc

    def _status(self) -> dict:
        deadline = time.monotonic() + self.plan.timeout_s
        while True:  # bounded: a coordinator being replaced answers again within the timeout
            try:
                return self.client.status()
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(POLL_S)

    def _restarts(self, status: dict | None = None) -> dict[str, int]:
        now = {n: m["restarts"] for n, m in (status or self._status())["members"].items()}
        total = {n: now.get(n, 0) + self.carried.get(n, 0) for n in {*now, *self.carried}}
        coordinator = {"coordinator": self.coordinator_restarts} if self.coordinator_restarts else {}
        return {n: c for n, c in total.items() if c} | coordinator

    def _stored(self) -> int:
        members = self._status()["members"]
        return sum(int(m["info"].get("episodes", 0)) - int(m["info"].get("pending", 0)) for m in members.values() if m["role"] == "robot")

    # ------------------------------------------------------------------ faults
    def _fault_phase(self) -> None:
        schedule = deque(fault_schedule(self.plan))
        self.report.schedule = list(schedule)
        end = max(self.plan.duration_s, schedule[-1].at_s + self.plan.window_s)
        while (t := self._t()) < end or schedule:
            if t > end + self.plan.timeout_s:
                self.report.skipped = [f.kind for f in schedule]
                log.warning("chaos: never possible, skipped: %s", self.report.skipped)
                break
            while schedule and schedule[0].at_s <= t:
                fault = schedule.popleft()
                if not self._inject(fault.kind):  # later, without holding up the faults behind it
                    later = ScheduledFault(round(t + DEFER_S, 2), fault.kind)
                    schedule.insert(sum(f.at_s <= later.at_s for f in schedule), later)
            self._heal()
            self._sample()
            time.sleep(POLL_S)

    def _record(self, kind: str, target: str, pid: int = 0, detail: str = "") -> None:
        fault = Fault(self._t(), kind, target, pid, detail)
        self.report.faults.append(fault)
        self.report.faults_by_kind[kind] = self.report.faults_by_kind.get(kind, 0) + 1
        log.info("chaos fault at %.1fs: %s %s %s", fault.at_s, kind, target, detail)
        self.progress(f"  fault {len(self.report.faults):>3} at {fault.at_s:6.1f}s: {kind} {target} {detail}".rstrip())

    def _inject(self, kind: str) -> bool:
        """Inject one fault now; False when it cannot happen yet (then it is retried later)."""
        if kind == "coordinator":
            self._kill_coordinator()
            return True
        if kind in KILLS:
            return self._kill_member(kind)
        if kind in NETWORK:
            return self._network(kind)
        if kind == "disk_full":
            return self._fill_disk()
        if kind == "disk_quota":
            return self._limit_ingest_writes()
        if kind == "revoke":
            return self._revoke()
        raise ValueError(f"unknown fault kind {kind!r}; use one of {FAULT_KINDS}")

    def _running_robots(self, members: dict) -> list[str]:
        revoked = set(read_token_file(self.layout.token_file).revoked_robots)
        return sorted(n for n, m in members.items() if m["role"] == "robot" and m["alive"] and not m["done"] and n not in revoked)

    def _kill_member(self, kind: str) -> bool:
        members = self._status()["members"]
        if kind == "trainer" and trainer_status(self.layout).get("step", 0) < self.settings.runtime.checkpoint_every:
            return False  # "resumed from a checkpoint" needs one to exist
        if kind == "robot":
            running = self._running_robots(members)
            if not running:
                return False
            name = str(self.rng.choice(running))
        else:
            name = kind
        pid = members[name]["pid"]
        if not (members[name]["alive"] and pid and kill_pid(pid)):
            return False  # between a death and its restart: try again shortly
        self._record(kind, name, pid)
        return True

    def _kill_coordinator(self) -> None:
        for name, member in self._status()["members"].items():
            self.carried[name] = self.carried.get(name, 0) + member["restarts"] + 1
        pid = self.coordinator.pid
        kill_pid(pid)
        self.coordinator.wait()
        self._record("coordinator", "coordinator", pid)
        killed_at = time.monotonic()
        outlived = wait_gone(fleet_processes(self.settings_file), self.grace * 2, POLL_S)
        self.report.outlived_coordinator += len(outlived)
        stop_verified(outlived, self.grace, POLL_S)  # what `fleet up` does with orphans
        for member in outlived:
            gone = f"gone {time.monotonic() - killed_at:.1f} s after the kill" if not member.running() else "still running"
            self.report.outlived.append(f"{member.cmdline} (pid {member.pid}): stopped by SIGTERM/SIGKILL, {gone}")
        self._start_coordinator()
        self.coordinator_restarts += 1

    def _network(self, kind: str) -> bool:
        if kind in ("reset", "drop") and not any(p.open_connections for p in self.proxies.values()):
            return False  # nothing to cut (the fleet is restarting, or a drop is on): later
        if kind == "reset":
            for proxy in self.proxies.values():
                proxy.reset()
            self._record(kind, "inference+ingest proxies")
            return True
        mode = DROP if kind == "drop" else DELAY
        for proxy in self.proxies.values():
            proxy.set_mode(mode, self.plan.net_delay_s)
        self._later(kind, lambda: [p.set_mode(PASS) for p in self.proxies.values()])
        detail = f"{self.plan.window_s:.0f}s" + (f", +{self.plan.net_delay_s}s per chunk" if mode == DELAY else "")
        self._record(kind, "inference+ingest proxies", detail=detail)
        return True

    def _fill_disk(self) -> bool:
        """Take the dataset's filesystem half the headroom below the reserve (a real, allocated file)."""
        filler = self._dataset_fs() / FILLER_NAME
        if filler.exists():
            return False
        size = shutil.disk_usage(self._dataset_fs()).free - self.settings.runtime.min_free_bytes + self.headroom // 2
        if size <= 0:
            return False
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        self._later("disk_full", lambda: filler.unlink(missing_ok=True))
        self._record("disk_full", str(filler.parent), detail=f"{size / 2**30:.2f} GiB filler for {self.plan.window_s:.0f}s")
        return True

    def _limit_ingest_writes(self) -> bool:
        ingest = self._status()["members"]["ingest"]
        identity = ProcessIdentity.of(ingest["pid"]) if ingest["alive"] and ingest["pid"] else None
        if identity is None:
            return False
        soft, hard = resource.prlimit(identity.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(identity.pid, resource.RLIMIT_FSIZE, (0, hard))

        def undo() -> None:
            if ProcessIdentity.of(identity.pid) == identity:  # the same process, not a reused pid
                resource.prlimit(identity.pid, resource.RLIMIT_FSIZE, (soft, hard))

        self._later("disk_quota", undo)
        self._record("disk_quota", "ingest", identity.pid, f"RLIMIT_FSIZE 0 for {self.plan.window_s:.0f}s")
        return True

    def _revoke(self) -> bool:
        status = self._status()
        running = self._running_robots(status["members"])
        if not running:
            return False
        robot = str(self.rng.choice(running))
        before = self._restarts(status).get(robot, 0)
        at = self._t()
        revoke_robot(self.layout.token_file, robot)

        def readmit() -> None:
            status = self._status()
            member = status["members"].get(robot)
            issue_tokens(self.layout.token_file, self.settings.fleet.robot_ids(), readmit=(robot,))
            failures = member["failures"] if member is not None else None
            delays = member["restart_delays"][-failures:] if member is not None and failures else []
            restarts = self._restarts(status).get(robot, 0) - before
            self.report.revocations.append(Revocation(robot, at, round(self._t() - at, 2), restarts, failures, delays))

        # the coordinator notices only when the robot's lease lapses: revoked for the window after that
        window = self.settings.runtime.lease_s + self.plan.window_s
        self._later("revoke", readmit, window)
        self._record("revoke", robot, detail=f"re-issued after {window:.0f}s")
        return True

    def _later(self, kind: str, undo: Callable[[], None], window_s: float | None = None) -> None:
        self.heals.append((self._t() + (self.plan.window_s if window_s is None else window_s), kind, undo))

    def _heal(self, every: bool = False) -> None:
        t = self._t()
        due = [h for h in self.heals if every or h[0] <= t]
        self.heals = [h for h in self.heals if h not in due]
        for _, kind, undo in due:
            try:
                undo()
                log.info("chaos: %s healed at %.1fs", kind, t)
            except Exception:  # noqa: BLE001 - one failed heal must not leave the others in place
                log.exception("chaos: healing %s failed", kind)

    # ------------------------------------------------------------------ timeline
    def _sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if now < self._next_sample and not force:
            return
        self._next_sample = now + self.plan.sample_s
        status = self._status()
        for name, member in status["members"].items():
            info = member["info"]
            if member["role"] == "robot" and "episodes" in info:
                self.robot_counts[name] = (int(info["episodes"]), int(info["episodes"]) - int(info.get("pending", 0)))
        restarts = self._restarts(status)
        t = self._t()
        for name, count in restarts.items():
            series = self.restart_series.setdefault(name, [(0.0, 0)])
            if count != series[-1][1]:
                series.append((t, count))
        self.fleet_restarts.append((t, sum(restarts.values())))
        champion = status.get("aliases", {}).get(self.settings.registry.champion_alias)
        point = TimelinePoint(
            t, sum(f for f, _ in self.robot_counts.values()), sum(s for _, s in self.robot_counts.values()),
            int(champion) if champion is not None else None, sum(restarts.values()),
        )
        self.report.timeline.append(point)
        if now >= self._next_progress:
            self._next_progress = now + max(10.0, self.plan.sample_s)
            self.progress(
                f"t={t:6.0f}s/{self.plan.duration_s:.0f}s finished {point.finished} stored {point.stored} "
                f"faults {len(self.report.faults)} restarts {point.restarts} champion v{point.champion}"
            )

    # ------------------------------------------------------------------ end
    def _wait_recovered(self) -> None:
        """Every killed member came back, and a killed trainer resumed and checkpointed past its
        resume (the audit reads the resume log from the newest checkpoint)."""
        killed = {f.target for f in self.report.faults if f.kind in KILLS}
        deadline = time.monotonic() + self.plan.timeout_s
        while time.monotonic() < deadline:  # a kill just before the end: give the restart time
            restarts = self._restarts()
            if all(restarts.get(t, 0) >= 1 for t in killed) and ("trainer" not in killed or self._trainer_went_on()):
                return
            time.sleep(POLL_S)
        log.warning("chaos: not every killed member recovered within %.0fs", self.plan.timeout_s)

    def _trainer_went_on(self) -> bool:
        status = trainer_status(self.layout)
        resumes = status.get("resumes", [])
        return bool(resumes) and status.get("step", 0) >= resumes[-1] + self.settings.runtime.checkpoint_every

    def _drain(self) -> None:
        """`fleet down`, then `fleet up` with robots that only upload what they spooled."""
        self._sample(force=True)
        for name, member in self._status()["members"].items():
            self.carried[name] = self.carried.get(name, 0) + member["restarts"]
        self.report.restarts = self._restarts()
        self._stop_fleet()
        self.progress(f"t={self._t():6.0f}s drain: every fault healed; robots upload their spools and stop")
        runtime = self.settings.runtime.model_copy(update={"robot_episodes": DRAIN_EPISODES})
        self.settings_file = write_settings(self.settings.model_copy(update={"runtime": runtime}))
        self._start_coordinator()
        deadline = time.monotonic() + self.plan.timeout_s
        while time.monotonic() < deadline:
            body = self._status()
            if body["robots_done"] == body["robots"]:
                self.report.completed = True
                break
            time.sleep(POLL_S)
        self._sample(force=True)
        self.progress(f"t={self._t():6.0f}s drained: {'complete' if self.report.completed else 'TIMED OUT'}")

    def _stop_fleet(self) -> None:
        """SIGTERM the coordinator (it stops its members); anything of this root left is a leak."""
        if self.coordinator is not None:
            stop_process(self.coordinator, self.grace * 4)
        leaked = wait_gone(fleet_processes(self.settings_file), self.grace, POLL_S)
        self.report.leaked_pids += sorted(p.pid for p in leaked)
        stop_verified(leaked, self.grace, POLL_S)

    def _teardown(self) -> None:
        self._heal(every=True)
        try:
            self._stop_fleet()
        finally:
            if self.client is not None:
                self.client.close()
            for name, proxy in self.proxies.items():
                proxy.stop()
                self.report.proxy[name] = asdict(proxy.stats)
            (self._dataset_fs() / FILLER_NAME).unlink(missing_ok=True)

    def _summarize(self) -> None:
        report = self.report
        report.restarts_total = sum(report.restarts.values())
        report.max_member_restarts_per_min = max((max_in_window(s, RATE_WINDOW_S) for s in self.restart_series.values()), default=0)
        report.max_fleet_restarts_per_min = max_in_window(self.fleet_restarts, RATE_WINDOW_S) if self.fleet_restarts else 0
        versions = [p.champion for p in report.timeline if p.champion is not None]
        report.champion_versions = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
        report.promotions = max(0, len(report.champion_versions) - 1)


def run_chaos(settings: Settings, plan: ChaosPlan, progress: Callable[[str], None] | None = None) -> ChaosReport:
    """Run the fleet under the fault schedule, drain, stop everything, audit; leaves no process behind."""
    return ChaosRun(settings, plan, progress).run()
