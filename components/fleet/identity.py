"""Who a process is: pid + kernel start time + command line, so a pid alone is never trusted.

    ProcessIdentity.of(pid)       read /proc/<pid>/stat (start time, field 22) and cmdline
    identity.running()            the same process still runs (pid reuse gives another start time)
    identity.is_fleet(role)       its command line is ``components.fleet.serve <role>``
    signal_verified(identity, s)  signal only if both hold; False (nothing sent) otherwise
    write_pid_file / read_pid_file   JSON {pid, start_time, cmdline}: a stale or reused pid reads as None

Children of the coordinator also watch their parent (``watch_parent``): when the coordinator dies
(SIGKILL included) the kernel sends them SIGTERM (``PR_SET_PDEATHSIG``), and a thread that sees
them re-parented does the same, so no member outlives it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from components.fsio import atomic_write_bytes

log = logging.getLogger(__name__)

SERVE_MODULE = "components.fleet.serve"
PARENT_ENV = "FLEETLOOP_FLEET_PARENT"  # the coordinator's pid, set in every member's environment
PR_SET_PDEATHSIG = 1
ORPHAN_EXIT = 70  # exit code of a member that outlived its coordinator's grace period
STAT_STARTTIME_FIELD = 22  # 1-based, in /proc/<pid>/stat (man 5 proc)
STAT_UTIME_FIELD, STAT_STIME_FIELD = 14, 15  # 1-based: user and system CPU time, in clock ticks


def _stat_field(rest: list[str], field: int) -> str:
    """Field ``field`` (1-based, man 5 proc) of a /proc/<pid>/stat line split by ``_stat_rest``."""
    return rest[field - 3]


def _stat_rest(stat: str) -> list[str]:
    """Fields 3 onwards of a /proc/<pid>/stat line: the command name (field 2) may hold spaces
    and parentheses, so split after its last ')'."""
    return stat[stat.rfind(")") + 2 :].split()


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as the kernel knows it; two identities are the same process iff all fields match."""

    pid: int
    start_time: int  # clock ticks after boot
    cmdline: str  # arguments joined by spaces

    @classmethod
    def of(cls, pid: int) -> "ProcessIdentity | None":
        """The identity of a live process, or None if there is no such process (or it is a zombie)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        rest = _stat_rest(stat)
        if rest[0] == "Z":
            return None  # exited, not yet reaped: not running
        start_time = int(_stat_field(rest, STAT_STARTTIME_FIELD))
        return cls(pid, start_time, raw.replace(b"\0", b" ").decode(errors="replace").strip())

    def running(self) -> bool:
        """This very process still runs (same pid *and* start time)."""
        now = ProcessIdentity.of(self.pid)
        return now is not None and now.start_time == self.start_time

    def is_fleet(self, role: str | None = None) -> bool:
        """The command line is a fleet process (of ``role``, when given)."""
        args = self.cmdline.split()
        if SERVE_MODULE not in args:
            return False
        return role is None or args[args.index(SERVE_MODULE) + 1 : args.index(SERVE_MODULE) + 2] == [role]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "ProcessIdentity | None":
        try:
            return cls(int(raw["pid"]), int(raw["start_time"]), str(raw.get("cmdline", "")))
        except (KeyError, TypeError, ValueError):
            return None


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) ``pid`` has used so far; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = _stat_rest(stat)
    ticks = int(_stat_field(rest, STAT_UTIME_FIELD)) + int(_stat_field(rest, STAT_STIME_FIELD))
    return ticks / os.sysconf("SC_CLK_TCK")


def live_identity(recorded: ProcessIdentity | None, role: str | None = None) -> ProcessIdentity | None:
    """``recorded`` if that process still runs and is a fleet process (of ``role``); else None."""
    if recorded is None or not recorded.running():
        return None
    current = ProcessIdentity.of(recorded.pid)
    return current if current is not None and current.is_fleet(role) else None


def signal_verified(recorded: ProcessIdentity, sig: int, role: str | None = None) -> bool:
    """Send ``sig`` only to the process ``recorded`` names (same start time, a fleet command line)."""
    if live_identity(recorded, role) is None:
        return False
    try:
        os.kill(recorded.pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_gone(identities: list[ProcessIdentity], timeout_s: float, poll_s: float) -> list[ProcessIdentity]:
    """Wait (bounded) until none of ``identities`` runs; returns those still running."""
    deadline = time.monotonic() + timeout_s
    alive = [i for i in identities if i.running()]
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = [i for i in alive if i.running()]
    return alive


def stop_verified(identities: list[ProcessIdentity], grace_s: float, poll_s: float, role: str | None = None) -> list[int]:
    """SIGTERM each verified process, SIGKILL what is left after ``grace_s``; returns pids signalled."""
    signalled = [i for i in identities if signal_verified(i, signal.SIGTERM, role)]
    for straggler in wait_gone(signalled, grace_s, poll_s):
        signal_verified(straggler, signal.SIGKILL, role)
    wait_gone(signalled, grace_s, poll_s)
    return [i.pid for i in signalled]


def fleet_processes(settings_file: Path) -> list[ProcessIdentity]:
    """Every live fleet process started for one root: command line ``components.fleet.serve ...
    --settings <that root's settings file>`` (how `fleet down` finds members a dead coordinator
    never got to record)."""
    wanted = str(Path(settings_file).resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        identity = ProcessIdentity.of(int(entry.name))
        if identity is None or not identity.is_fleet():
            continue
        try:  # the raw arguments: a root path may hold spaces
            args = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if "--settings" in args and args.index("--settings") + 1 < len(args):
            if str(Path(args[args.index("--settings") + 1]).resolve()) == wanted:
                found.append(identity)
    return sorted(found, key=lambda i: i.pid)


def write_pid_file(path: Path) -> ProcessIdentity:
    """Record this process's identity at ``path`` (atomically)."""
    me = ProcessIdentity.of(os.getpid())
    if me is None:
        raise RuntimeError(f"/proc/{os.getpid()} is not readable: the fleet runtime needs Linux procfs")
    atomic_write_bytes(path, json.dumps(me.to_dict()).encode())
    return me


def read_pid_file(path: Path, role: str | None = None) -> ProcessIdentity | None:
    """The live fleet process ``path`` names, or None: missing, unreadable, stale or reused pids all read as None."""
    try:
        recorded = ProcessIdentity.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, AttributeError):
        return None
    return live_identity(recorded, role)


def remove_pid_file_if_mine(path: Path) -> None:
    """Remove ``path`` if it names this process (signal-safe to call from any shutdown path)."""
    try:
        recorded = ProcessIdentity.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, AttributeError):
        return
    if recorded is not None and recorded.pid == os.getpid():
        Path(path).unlink(missing_ok=True)


def watch_parent(poll_s: float, grace_s: float) -> threading.Thread | None:
    """In a coordinator's member: die with the coordinator (SIGTERM to self), however it died.

    Two mechanisms: ``PR_SET_PDEATHSIG`` (the kernel signals us when the parent goes) and a daemon
    thread that sees us re-parented (covers the race before prctl); if the graceful stop takes
    longer than ``grace_s`` the thread ends the process. Returns the thread, or None when this process was not started by a coordinator.
    """
    raw = os.environ.get(PARENT_ENV, "")
    if not raw.isdigit():
        return None
    parent = int(raw)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent watch thread")

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.error("the coordinator (pid %d) is gone: stopping, a member never outlives it", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        log.error("still running %.1fs after the coordinator died: exiting now", grace_s)
        os._exit(ORPHAN_EXIT)

    thread = threading.Thread(target=run, name="parent-watch", daemon=True)
    thread.start()
    return thread
