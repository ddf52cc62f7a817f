"""`fleetloop fleet ...`: run the fault-tolerant fleet runtime (components/fleet) from the shell.

    fleet up [--detach]      coordinator + ingest + inference + trainer + one agent per robot
    fleet status [--json]    who runs, restarts, leases, served versions (per robot too), canary
    fleet down               stop everything (SIGTERM, then SIGKILL after the grace period)
    fleet tokens [--rotate]  issue per-robot tokens into the token file (values never printed)
    fleet revoke ROBOT       revoke one robot's token (403 from then on)
    fleet canary VERSION     roll VERSION out to runtime.canary_share of the fleet
    fleet chaos              the bounded chaos run (scratch root by default), report as JSON
"""

from __future__ import annotations

import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from cli.output import cell, say, to_json

fleet_app = typer.Typer(help="FATS: the fault-tolerant asynchronous fleet runtime.", no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)  # an error stays one line, whatever the terminal width

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
START_TIMEOUT_S = 180.0
START_GRACE_MARGIN_S = 5.0  # on top of the coordinator's own stop budget before it is killed


def _fail(message: str, fix: str) -> None:
    err.print(f"[red]error:[/red] {message}\n[dim]fix:[/dim] {fix}")
    raise typer.Exit(code=1)


def _settings(robots: int | None = None, episodes: int | None = None):
    from components.config import load_settings

    settings = load_settings()
    if robots is not None:
        settings = settings.model_copy(update={"fleet": settings.fleet.model_copy(update={"num_robots": robots})})
    if episodes is not None:
        settings = settings.model_copy(update={"runtime": settings.runtime.model_copy(update={"robot_episodes": episodes})})
    return settings


POLL_S = 0.1


def _coordinator(settings):
    """The running coordinator's verified identity (pid + start time + command line), or None.

    A stale pid file (the process is gone, or its pid now names another program) reads as None
    and is removed, so no command ever signals a process the fleet did not start.
    """
    from components.fleet.identity import read_pid_file
    from components.fleet.layout import RuntimeLayout

    path = RuntimeLayout.of(settings).coordinator_pid_file
    identity = read_pid_file(path, "coordinator")
    if identity is None:
        path.unlink(missing_ok=True)
    return identity


def _members(settings, coordinator) -> list:
    """Live fleet processes of this root other than the coordinator (orphans if it is down)."""
    from components.fleet.identity import fleet_processes
    from components.fleet.layout import RuntimeLayout

    others = fleet_processes(RuntimeLayout.of(settings).settings_file)
    return [p for p in others if coordinator is None or p.pid != coordinator.pid]


def _stop_members(settings, members) -> list[int]:
    """SIGTERM, then SIGKILL after the grace period: verified identities only."""
    from components.fleet.identity import stop_verified

    return stop_verified(members, settings.runtime.stop_grace_s, POLL_S)


@fleet_app.command()
def up(
    detach: Annotated[bool, typer.Option(help="Start in the background and return.")] = False,
    robots: Annotated[Optional[int], typer.Option(help="Robots in the fleet (default fleet.num_robots).")] = None,
    episodes: Annotated[Optional[int], typer.Option(help="Episodes per robot; 0 = until stopped.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Start the fleet on runtime.host (127.0.0.1 by default)."""
    from components.fleet.auth import issue_tokens
    from components.fleet.layout import RuntimeLayout
    from components.fleet.local import service_url
    from components.fleet.processes import ProcessSpec, start_process, stop_process, wait_healthy, write_settings

    from components.fleet.identity import read_pid_file

    settings = _settings(robots, episodes)
    if _coordinator(settings) is not None:
        _fail("the fleet is already up", "run `fleetloop fleet status`, or `fleetloop fleet down` first")
    orphans = _members(settings, None)
    starting = [p.pid for p in orphans if p.is_fleet("coordinator")]
    if starting:  # its pid file is not written yet (or it hangs): never take it for an orphan
        _fail(f"a coordinator (pid {starting}) runs without a pid file: starting, or stuck", "wait and retry, or `fleetloop fleet down`")
    if orphans:  # a coordinator died and left members: never start a second set beside them
        stopped = _stop_members(settings, orphans)
        err.print(f"[yellow]stopped {len(stopped)} orphaned fleet processes of a dead coordinator: {stopped}[/yellow]")
        if _members(settings, None):
            _fail("orphaned fleet processes would not stop", "run `fleetloop fleet down`, then retry")
    layout = RuntimeLayout.of(settings).ensure()
    issue_tokens(layout.token_file, settings.fleet.robot_ids())  # keeps existing tokens
    settings_file = write_settings(settings)
    proc = start_process(ProcessSpec("coordinator", "coordinator"), settings_file, layout.logs)
    url = service_url(settings, "coordinator")
    healthy = wait_healthy(url, START_TIMEOUT_S, proc)
    running = read_pid_file(layout.coordinator_pid_file, "coordinator")
    if not healthy or running is None or running.pid != proc.pid:  # the answer must come from ours
        stop_process(proc, settings.runtime.stop_grace_s)
        _fail(f"the coordinator did not start; see {layout.logs / 'coordinator.log'}", "fix the error in that log and retry")
    say(console, {"coordinator_pid": proc.pid, "url": url, "robots": settings.fleet.num_robots,
                  "logs": str(layout.logs), "token_file": str(layout.token_file)}, as_json,
        f"fleet up: coordinator pid {proc.pid} at {url}; {settings.fleet.num_robots} robots; "
        f"logs in {layout.logs}; tokens in {layout.token_file}")
    if detach:
        return
    if not as_json:
        console.print("[dim]Ctrl-C stops the fleet[/dim]")
    try:
        while proc.poll() is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        stop_process(proc, settings.runtime.stop_grace_s * 4)


@fleet_app.command()
def down(as_json: JsonOpt = False) -> None:
    """Stop the coordinator (which stops its members), then any member still running; verified
    identities only (pid + start time + command line), and nothing of this root is left running."""
    from components.fleet.identity import signal_verified, stop_verified, wait_gone
    from components.fleet.layout import RuntimeLayout

    settings = _settings()
    layout = RuntimeLayout.of(settings)
    grace = settings.runtime.stop_grace_s
    coordinator = _coordinator(settings)
    if coordinator is not None:
        signal_verified(coordinator, signal.SIGTERM, "coordinator")
        # the coordinator gives each member stop_grace_s; then it gets as long itself
        if wait_gone([coordinator], grace * 2 + START_GRACE_MARGIN_S, POLL_S):
            stop_verified([coordinator], grace, POLL_S, "coordinator")
    leftovers = _stop_members(settings, _members(settings, None))
    still = _members(settings, None) + ([coordinator] if coordinator is not None and coordinator.running() else [])
    if coordinator is not None and not coordinator.running():
        layout.coordinator_pid_file.unlink(missing_ok=True)  # it was killed, so it could not clean up
    if still:
        _fail(f"fleet processes still running: {[p.pid for p in still]}", "check them with `ps -fp PID` and stop them by hand")
    say(console, {"stopped_leftovers": leftovers}, as_json, f"fleet down{f' (stopped leftovers {leftovers})' if leftovers else ''}")


@fleet_app.command()
def status(as_json: JsonOpt = False) -> None:
    """Members, pids, restarts, heartbeat ages, served versions (``serving``: per robot) and the canary."""
    from components.fleet.layout import RuntimeLayout

    from components.fleet.identity import ProcessIdentity, live_identity

    settings = _settings()
    path = RuntimeLayout.of(settings).status_file
    coordinator = _coordinator(settings)
    orphans = [] if coordinator is not None else [p.pid for p in _members(settings, None)]
    if not path.exists() and coordinator is None and not orphans:
        _fail("no fleet status yet", "start the fleet with `fleetloop fleet up`")
    try:
        body = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # not written yet: what runs is still known
        body = {"members": {}, "served": {}, "serving": {}, "canary": {}}
    body["coordinator_running"] = coordinator is not None
    # status.json is what the coordinator last wrote; "alive" is checked now, per recorded identity
    for member in body["members"].values():
        recorded = ProcessIdentity.from_dict(member.get("identity") or {})
        member["alive"] = live_identity(recorded) is not None
    body["orphans"] = orphans
    if body["orphans"]:
        err.print(f"[red]the coordinator is down but fleet processes {body['orphans']} still run[/red]: `fleetloop fleet down` stops them")
    if as_json:
        print(to_json(body))
        return
    console.print(_members_table(body))
    info = _info_table(body)
    if info is not None:
        console.print(info)
    console.print(_status_summary(body), soft_wrap=True)


def _members_table(body: dict) -> Table:
    """One row per member, short columns only, so 80 columns hold them: names never wrap or shrink
    (the column is as wide as the longest). Each member's free-form info is ``_info_table``'s."""
    names = list(body["members"])
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("member", no_wrap=True, min_width=max(map(len, names), default=0))
    for col in ("role", "pid", "state", "restarts", "beat s"):  # beat s: since the last heartbeat
        table.add_column(col, no_wrap=True)
    table.add_column("serves", overflow="fold")
    serving = body.get("serving") or {}
    for name, m in body["members"].items():
        table.add_row(
            name, m["role"], cell(m["pid"]), _state(m), cell(m["restarts"]),
            "" if m["heartbeat_age_s"] is None else f"{m['heartbeat_age_s']:.1f}", serving.get(name) or "",
        )
    return table


def _state(member: dict) -> str:
    """up / down, and done once a robot has finished its episodes."""
    return ("up" if member["alive"] else "down") + (", done" if member["done"] else "")


def _info_table(body: dict) -> Table | None:
    """What each member last reported (its heartbeat info), wrapped: paths fold, never cut."""
    rows = [(name, cell(m["info"])) for name, m in body["members"].items() if m.get("info")]
    if not rows:
        return None
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("member", no_wrap=True)
    table.add_column("info", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _status_summary(body: dict) -> str:
    members = body["members"].values()
    alive = sum(1 for m in members if m["alive"])
    robots = [m for m in members if m["role"] == "robot"]
    aliases = ", ".join(f"{k} v{v}" for k, v in (body.get("aliases") or {}).items()) or "no aliases"
    return (
        f"fleet {'up' if body['coordinator_running'] else 'down'}: {alive}/{len(body['members'])} members alive, "
        f"{sum(1 for r in robots if r['done'])}/{len(robots)} robots done; {aliases}; "
        f"served {cell(body.get('served'))}; canary {cell(body.get('canary') or None)}"
    )


@fleet_app.command()
def tokens(
    rotate: Annotated[bool, typer.Option(help="Replace every token (old ones are revoked).")] = False,
    readmit: Annotated[list[str], typer.Option(help="Revoked robot id to give a new token (repeatable).")] = [],  # noqa: B006
    as_json: JsonOpt = False,
) -> None:
    """Issue per-robot tokens (and the service token) into the token file; prints no token.
    Revoked robots get none (a revoke stays revoked) unless named with ``--readmit``."""
    from components.fleet.auth import issue_tokens
    from components.fleet.layout import RuntimeLayout

    settings = _settings()
    layout = RuntimeLayout.of(settings).ensure()
    book = issue_tokens(layout.token_file, settings.fleet.robot_ids(), rotate=rotate, readmit=readmit)
    barred = f"; revoked, no token: {', '.join(book.revoked_robots)}" if book.revoked_robots else ""
    say(console, {"robots": len(book.robots), "token_file": str(layout.token_file), "rotated": rotate,
                  "revoked_robots": list(book.revoked_robots)}, as_json,
        f"{len(book.robots)} robot tokens + 1 service token in {layout.token_file} (mode 0600){barred}")


@fleet_app.command()
def revoke(robot: Annotated[str, typer.Argument(help="Robot id whose token to revoke.")], as_json: JsonOpt = False) -> None:
    """Revoke a robot's token: its requests get 403 from now on (services re-read the file)."""
    from components.fleet.auth import revoke_robot
    from components.fleet.layout import RuntimeLayout

    settings = _settings()
    try:
        revoke_robot(RuntimeLayout.of(settings).token_file, robot)
    except KeyError as exc:
        _fail(str(exc), "pass a robot id that has a token (`fleetloop fleet tokens`)")
    say(console, {"revoked": robot}, as_json, f"revoked the token of {robot}")


@fleet_app.command()
def canary(version: Annotated[int, typer.Argument(help="Registered model version to roll out.")], as_json: JsonOpt = False) -> None:
    """Start a canary rollout; the coordinator promotes or rolls it back on live outcomes."""
    from components.episodes.dataset import EpisodeDataset
    from components.registry.canary import CanaryRollout
    from components.registry.model_registry import PolicyRegistry

    settings = _settings()
    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
    decision = CanaryRollout(registry, dataset, settings.runtime).start(version)
    say(console, {"version": version, "action": decision.action, "reason": decision.reason}, as_json,
        f"v{version}: {decision.action} ({decision.reason})")


@fleet_app.command()
def chaos(
    robots: Annotated[int, typer.Option(help="Robots in the fleet.")] = 4,
    seconds: Annotated[float, typer.Option(help="Length of the fault phase (at least one round of every fault kind).")] = 40.0,
    seed: Annotated[int, typer.Option(help="Seed of the fault schedule.")] = 0,
    max_steps: Annotated[int, typer.Option(help="Steps per episode (short keeps the run small).")] = 30,
    root: Annotated[Optional[Path], typer.Option(help="Root to run in (default: a scratch folder).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """SIGKILL every kind of member (the coordinator too), drop/delay/reset connections, fill the
    disk, revoke a token; drain; audit what was stored against every robot's ledger."""
    from components.config import Settings
    from components.fleet.chaos import ChaosPlan, chaos_settings, run_chaos

    base = _settings()
    scratch = root or Path(tempfile.mkdtemp(prefix="fleetloop-chaos-"))
    settings = Settings(**{**base.model_dump(exclude={"runtime": {"tokens"}}), "root": scratch})
    settings = settings.model_copy(update={"sim": settings.sim.model_copy(update={"max_steps": max_steps})})
    plan = ChaosPlan(robots=robots, duration_s=seconds, seed=seed)
    report = run_chaos(chaos_settings(settings, plan), plan, progress=None if as_json else console.print)
    if as_json:
        console.print_json(report.to_json())
        return
    console.print(
        f"robots {robots}, {seconds:.0f}s of faults, {report.seconds}s in all ({scratch}): finished {report.finished}, "
        f"stored {report.stored}, duplicated {report.duplicated}, lost {report.lost}, corrupted {report.corrupted}; "
        f"faults {len(report.faults)} ({', '.join(f'{k} {n}' for k, n in sorted(report.faults_by_kind.items()))}); "
        f"trainer resumed at {report.trainer_resumes}, {report.trainer_steps} steps"
    )
    if report.lost or report.duplicated or report.corrupted or not report.completed or report.leaked_pids or report.outlived_coordinator:
        raise typer.Exit(code=1)
