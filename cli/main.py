"""The `fleetloop` command: the face over flows and stages (typer + rich).

Errors are one line naming what is wrong plus the fix, with a non-zero exit code; commands that
report state take ``--json`` for scripts; long commands show a progress bar.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from cli.output import Blocks, emit, to_json
from components.registry.tracking import TrackingStoreError
from components.store.location import SegmentStoreError

app = typer.Typer(
    help="fleetloop: turn a robot fleet's own executions into a better shared policy.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err = Console(stderr=True, soft_wrap=True)  # an error stays one line, whatever the terminal width

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
VersionArg = Annotated[str, typer.Argument(help="Model version number, or an alias such as champion.")]


def _mount_fleet() -> None:
    from cli.fleet import fleet_app

    app.add_typer(fleet_app, name="fleet", help="The fault-tolerant asynchronous fleet runtime (FATS): up, down, status, tokens, canary, chaos.")


class CliError(Exception):
    """A user-facing error: what is wrong, and how to fix it."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def _settings():
    from flows.runtime import prepare_environment

    return prepare_environment()


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=False,
    )


def _quarantine_rows(quarantined) -> Blocks:
    """Quarantined files as people read them: one block each, long paths wrapped, nothing cut."""
    return Blocks({"file": q.source, "field": q.field, "reason": q.reason, "fix": q.fix, "moved to": str(q.path)}
                  for q in quarantined)


def _quarantine_lines(quarantined) -> list[str]:
    """The stable ``--json`` form of quarantined files (one string each)."""
    return [f"{q.source}: {q.field}: {q.reason}" for q in quarantined]


def _promotion_summary(promotion) -> str:
    verdict = "promoted" if promotion.decision.promote else "not promoted"
    return f"v{promotion.candidate.version} {verdict} ({promotion.decision.reason}); champion v{promotion.champion_after}"


# -- the loop ----------------------------------------------------------------------------------
def demo_table(rows: list, confidence: float) -> Table:
    """The demo's per-round table (CI reads it back: .ci/check_demo.py)."""
    table = Table(title=f"fleetloop demo: closed-loop rounds (held-out success, Wilson {100 * confidence:.0f}% CI)")
    for col in ("round", "robots", "episodes", "fleet success", "held-out success [CI]", "trials", "promoted", "champion",
                "method", "plan", "ms/iteration", "retrieved"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(
            r.round, str(r.robots), str(r.episodes), f"{100 * r.collected_success:.1f}%", r.heldout, str(r.trials),
            "yes" if r.promoted else "no", f"v{r.champion}", r.method, r.plan, r.iteration_ms, str(r.retrieved),
        )
    return table


@app.command()
def demo(as_json: JsonOpt = False) -> None:
    """Bootstrap from scripted-expert demos, then run fleet rounds on @champion; print a per-round table."""
    import dataclasses

    settings = _settings()
    from flows.demo import run_demo

    rows = []
    with _progress() as progress:
        bar = progress.add_task("closed-loop rounds", total=settings.demo.rounds + 1)
        for row in run_demo(settings):
            rows.append(row)
            progress.advance(bar)
    if as_json:
        print(to_json({"rounds": [dataclasses.asdict(r) for r in rows]}))
        return
    Console(width=max(console.width, 200)).print(demo_table(rows, settings.evaluation.confidence))
    console.print(demo_summary(rows), soft_wrap=True)


def demo_summary(rows) -> str:
    """The demo's last line: the champion it ends with and *its* held-out success (from the round
    that promoted it), not the last challenger's."""
    last = rows[-1]
    promoted = next((r for r in reversed(rows) if r.promoted and r.champion == last.champion), None)
    if promoted is None:
        return f"demo: {len(rows)} rounds; " + ("no champion" if last.champion is None else f"champion v{last.champion}")
    return f"demo: {len(rows)} rounds; champion v{last.champion} (promoted at {promoted.round}), held-out success {promoted.heldout}"


@app.command()
def ingest(
    files: Annotated[list[Path], typer.Argument(help="Episode files (one Parquet file or Arrow IPC stream per episode), or folders of them.")],
    as_json: JsonOpt = False,
) -> None:
    """Validate and ingest episode files; bad files go to quarantine with a reason, good ones are kept."""
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CliError(f"no such file: {', '.join(missing)}", "pass existing episode files")
    settings = _settings()
    from flows.ingest import run_ingest

    with _progress() as progress:
        progress.add_task(f"ingesting {len(files)} {'path' if len(files) == 1 else 'paths'}", total=None)
        result = run_ingest(files, settings)
    report = {
        "added": result.added, "duplicates": result.duplicates,
        "quarantined": _quarantine_lines(result.quarantined), "quarantined_total": result.quarantined_total,
        "snapshot": result.snapshot or None, "lancedb_version": result.store_version,
        "segments_upserted": result.segments_upserted,
    }
    snapshot = f"snapshot {result.snapshot}" if result.snapshot else "no new snapshot"
    more = f"; {result.unlisted} more quarantined files under {settings.paths.quarantine}" if result.unlisted else ""
    emit(console, report, as_json, f"ingest: {result.text}; {snapshot}{more}",
         people={**report, "quarantined": _quarantine_rows(result.quarantined)})


@app.command("store-upkeep")
def store_upkeep(as_json: JsonOpt = False) -> None:
    """Merge old small data files, compact the segment store, retrain its index as it grows, prune old versions (tagged ones are kept)."""
    settings = _settings()
    from flows.upkeep import run_upkeep

    with _progress() as progress:
        progress.add_task("store upkeep", total=None)
        report = run_upkeep(settings)
    body = {
        "versions": f"{report.versions_before} -> {report.versions_after}",
        "disk_mib": f"{report.bytes_before / 2**20:.1f} -> {report.bytes_after / 2**20:.1f}",
        "fragments": f"{report.fragments_before} -> {report.fragments_after}",
        "index": report.index_action,
        "lancedb_version": report.version_after, "tags_kept": report.tags,
    }
    emit(console, body, as_json, f"store upkeep: {body['versions']} versions, {body['disk_mib']} MiB, index {report.index_action}")


@app.command()
def retrain(
    files: Annotated[Optional[list[Path]], typer.Argument(help="Episode files to ingest first (default: all of datasets/incoming).")] = None,
    bootstrap: Annotated[bool, typer.Option("--bootstrap", help="Collect scripted-expert demos first.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the retrain flow: ingest → train → evaluate → register → promote."""
    settings = _settings()
    with _progress() as progress:
        progress.add_task("retrain", total=None)
        if bootstrap:
            from flows.fleet_round import bootstrap as bootstrap_flow

            _, promotion = bootstrap_flow(settings)
        else:
            from flows.retrain import retrain as retrain_flow

            promotion = retrain_flow(files or None, "retrain", settings)
    emit(console, {"version": promotion.candidate.version, "promoted": promotion.decision.promote,
                   "champion": promotion.champion_after, "gate": promotion.decision.reason}, as_json,
         f"retrain: {_promotion_summary(promotion)}")


@app.command("fleet-round")
def fleet_round(
    round_index: Annotated[Optional[int], typer.Option("--round", help="Round number (seeds the fleet); default: the next one.", min=1)] = None,
    robots: Annotated[Optional[int], typer.Option(help="Fleet size (default: fleet.num_robots).", min=1)] = None,
    as_json: JsonOpt = False,
) -> None:
    """The fleet runs @champion for its time budget, then retrain on what it did."""
    settings = _settings()
    from flows.fleet_round import fleet_round as fleet_round_flow

    with _progress() as progress:
        progress.add_task("fleet round", total=None)
        collected, promotion = fleet_round_flow(round_index, robots, settings)
    emit(console, {"episodes": collected.episodes, "fleet_success": collected.success_rate, "version": promotion.candidate.version,
                   "promoted": promotion.decision.promote, "champion": promotion.champion_after}, as_json,
         f"fleet round: {collected.episodes} episodes at {100 * collected.success_rate:.1f}% success; {_promotion_summary(promotion)}")


@app.command()
def rollback(as_json: JsonOpt = False) -> None:
    """Restore the previous champion (alias `previous` → `champion`)."""
    settings = _settings()
    from components.registry.model_registry import RegistryError
    from flows.rollback import rollback as rollback_flow

    try:
        restored = rollback_flow(settings)
    except RegistryError as exc:
        raise CliError(str(exc), "promote at least two models before rolling back") from exc
    emit(console, {"champion": restored.version}, as_json, f"rollback: champion: {restored.version} (the alias previous pointed at it)")


@app.command("train-node")
def train_node(
    node_rank: Annotated[Optional[int], typer.Option("--node-rank", help="This host's node rank, 1 or above (default: distributed.node_rank).", min=1)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Join node 0's expert-parallel training from another host (torchrun c10d rendezvous at
    distributed.rdzv_endpoint): receive its training set, train this host's experts; node 0 keeps the model."""
    from pydantic import ValidationError

    from components.config import DistributedConfig
    from components.pipeline.distributed import join_training
    from components.training.expert_parallel import ExpertParallelError

    settings = _settings()
    try:
        if node_rank is not None:
            distributed = DistributedConfig(**{**settings.distributed.model_dump(), "node_rank": node_rank})
            settings = settings.model_copy(update={"distributed": distributed})
        run = join_training(settings)
    except ValidationError as exc:
        raise CliError(exc.errors()[0]["msg"].removeprefix("Value error, "), "set distributed.nnodes in params.yaml "
                       "(the same on every host) and pass a --node-rank below it") from exc
    except ExpertParallelError as exc:
        raise _one_line(exc) from exc
    except ValueError as exc:
        raise CliError(str(exc), "see components/training/README.md (several hosts)") from exc
    d = settings.distributed
    report = {"node_rank": d.node_rank, "nodes": d.nnodes, "world_size": run.world_size, "steps": len(run.losses),
              "final_loss": run.losses[-1] if run.losses else None, "data_sha256": run.data_sha256,
              "rendezvous": f"{d.rdzv_id} at {d.rdzv_endpoint}"}
    emit(console, report, as_json, f"train-node: node {d.node_rank} of {d.nnodes} trained {len(run.losses)} steps "
         f"in a world of {run.world_size} ranks; node 0 keeps the model")


# -- data ----------------------------------------------------------------------------------------
@app.command("import-lerobot")
def import_lerobot(
    src: Annotated[Path, typer.Argument(help="A LeRobot v3 dataset folder (meta/info.json inside).")],
    robot_id: Annotated[str, typer.Option(help="Robot id for episodes that carry none.")] = "lerobot-import",
    as_json: JsonOpt = False,
) -> None:
    """Import a LeRobot v3 dataset into the episode dataset (an empty one adopts its fps and robot type)."""
    from components.episodes.dataset import DatasetMismatchError
    from components.episodes.lerobot import LeRobotFormatError
    from components.episodes.lerobot import import_lerobot as do_import
    from components.pipeline.workspace import Workspace

    if not (src / "meta" / "info.json").exists():
        raise CliError(f"{src} is not a LeRobot v3 dataset (no meta/info.json)", "point at the dataset root folder that contains meta/ and data/")
    settings = _settings()
    dataset = Workspace(settings).dataset
    try:
        with _progress() as progress:
            progress.add_task(f"importing {src.name}", total=None)
            result = do_import(src, dataset, robot_id=robot_id)
    except (LeRobotFormatError, DatasetMismatchError) as exc:
        raise _one_line(exc) from exc
    report = {
        "source": str(result.source), "added": len(result.report.added), "duplicates": len(result.report.duplicates),
        "quarantined": _quarantine_lines(result.report.quarantined), "frames_added": result.report.frames_added,
        "dataset": str(dataset.root), "fps": dataset.fps, "robot_type": dataset.info()["robot_type"],
        "mapping_file": str(result.mapping_file) if result.mapping_file else None,
    }
    emit(console, report, as_json, str(result), people={**report, "quarantined": _quarantine_rows(result.report.quarantined)})


def _one_line(exc: Exception) -> CliError:
    """A library error whose message ends in ". Fix: ..." as the CLI's message + fix."""
    message, _, fix = str(exc).partition(". Fix: ")
    return CliError(message, fix or "follow the message above")


@app.command("export-lerobot")
def export_lerobot(
    dst: Annotated[Path, typer.Argument(help="An empty or new folder for the LeRobot v3 dataset.")],
    as_json: JsonOpt = False,
) -> None:
    """Export the episode dataset in the LeRobot v3 layout."""
    from components.episodes.lerobot import LeRobotFormatError
    from components.episodes.lerobot import export_lerobot as do_export
    from components.pipeline.workspace import Workspace

    try:
        result = do_export(Workspace(_settings()).dataset, dst)
    except LeRobotFormatError as exc:
        raise _one_line(exc) from exc
    emit(console, {"path": str(result.path), "episodes": result.episodes, "frames": result.frames,
                   "data_files": result.data_files, "video_files": result.video_files}, as_json, str(result))


@app.command()
def stage(name: Annotated[str, typer.Argument(help="collect | ingest | train | evaluate")]) -> None:
    """Run one dvc.yaml stage (what `dvc repro` calls)."""
    from components.pipeline.dvc_stages import STAGES, run_stage

    if name not in STAGES:
        raise CliError(f"unknown stage {name!r}", f"use one of: {', '.join(STAGES)}")
    run_stage(name, _settings())


@app.command()
def evaluate(
    model_uri: Annotated[str, typer.Option(help="Model to evaluate, e.g. models:/fleetloop-policy/3 or models:/fleetloop-policy@champion.")],
    population_seed: Annotated[int, typer.Option(help="Sim population the test robots are drawn from (a fresh one: robots nobody has seen).", min=0)],
    robots: Annotated[int, typer.Option(help="Test robots (test-0000, ...).", min=1)] = 16,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate any registered model on a fresh population of test robots (never tuned, selected or gated on)."""
    from cli.reports import evaluation_report, evaluation_summary
    from components.pipeline.evaluate import PolicySimMismatch
    from components.registry.model_registry import RegistryError

    try:
        report = evaluation_report(_settings(), model_uri, robots, population_seed)
    except RegistryError as exc:
        raise CliError(str(exc), "list versions and aliases with `fleetloop status`; a URI reads models:/NAME/VERSION "
                                 "or models:/NAME@ALIAS") from exc
    except PolicySimMismatch as exc:
        raise CliError(exc.message, exc.fix) from exc
    emit(console, report, as_json, evaluation_summary(report))


# -- inspect -------------------------------------------------------------------------------------
@app.command()
def status(as_json: JsonOpt = False, runs: Annotated[int, typer.Option(help="How many recent runs to list.", min=0)] = 5) -> None:
    """The champion, the last runs and the data size."""
    from cli.reports import status_report, status_summary

    report = status_report(_settings(), runs)
    emit(console, report, as_json, status_summary(report))


@app.command()
def lineage(version: VersionArg, as_json: JsonOpt = False) -> None:
    """Model version → MLflow run → git commit, params, DVC snapshot, LanceDB version → episodes per robot."""
    from cli.reports import LineageNotFound, lineage_report, lineage_summary

    try:
        report = lineage_report(_settings(), version)
    except LineageNotFound as exc:
        raise CliError(str(exc), "list versions with `fleetloop status`") from exc
    emit(console, report, as_json, lineage_summary(report))


@app.command()
def reproduce(
    version: VersionArg,
    scratch: Annotated[Optional[Path], typer.Option("--scratch", help="New folder to rebuild in, kept (default: a temporary one, removed).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Rebuild a version from its lineage (DVC snapshot, store version, champion, settings) in a scratch
    root and compare the weights' digest with the registered model's; exit 1 when they differ."""
    import tempfile

    from components.pipeline.reproduce import ReproduceError, reproduce_version

    settings = _settings()
    with tempfile.TemporaryDirectory(prefix="fleetloop-reproduce-") as tmp:
        try:
            result = reproduce_version(settings, version, scratch or Path(tmp) / "root", log=err.print)
        except ReproduceError as exc:
            raise CliError(str(exc), "list versions with `fleetloop status`; see `fleetloop lineage VERSION`") from exc
    report = {**result.to_dict(), "scratch": str(scratch) if scratch else None}  # a temporary one is gone
    verdict = "reproduced: same weights" if result.matches else "NOT reproduced: the weights differ"
    commit = "" if result.same_commit else f" (trained at {result.trained_at_commit[:12]}, rebuilt at {result.current_commit[:12]})"
    emit(console, report, as_json, f"v{result.version} {verdict}, digest {result.rebuilt_digest[:16]}{commit}")
    if not result.matches:
        raise typer.Exit(1)


@app.command()
def explain(
    version: VersionArg,
    out: Annotated[Optional[Path], typer.Option("--out", help="Folder to write into (default: <root>/artifacts/explain/v<N>).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """A FERT version's failures beside the success windows they retrieved (a page per robot and per
    stage) and failures by stage before/after its round: the retrain flow's explain/ artifact, re-drawn."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # stderr stays for errors
    from cli.reports import explain_report, explain_summary
    from components.pipeline.explain import NothingToExplain
    from components.registry.model_registry import RegistryError

    try:
        report = explain_report(_settings(), version, out)
    except NothingToExplain as exc:
        raise CliError(str(exc), exc.fix) from exc
    except RegistryError as exc:
        raise CliError(str(exc), "list versions with `fleetloop status`") from exc
    emit(console, report, as_json, explain_summary(report), people={k: v for k, v in report.items() if k != "files"})


# -- operate -------------------------------------------------------------------------------------
@app.command()
def serve() -> None:
    """Serve `retrain` on a cron schedule and `fleet_round` on an interval (needs a Prefect server: `make ui`)."""
    settings = _settings()
    from flows.schedules import serve_deployments

    if "PREFECT_API_URL" not in os.environ:
        raise CliError(
            f"no Prefect server answers on 127.0.0.1:{settings.ops.prefect_port}",
            "start one with `make ui` (or set PREFECT_API_URL), then run `fleetloop serve` again",
        )
    serve_deployments(settings)


@app.command()
def ui() -> None:
    """Start the Prefect server and the MLflow UI on 127.0.0.1 (Ctrl-C stops both)."""
    settings = _settings()
    from cli.services import run_uis

    run_uis(settings, console)


_mount_fleet()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (errors: one line + the fix, code 1; usage errors: 2)."""
    try:
        result = app(args=argv, standalone_mode=False)
        return result if isinstance(result, int) else 0
    except CliError as exc:
        err.print(f"[red]error:[/red] {exc}\n[dim]fix:[/dim] {exc.fix}")
        return 1
    except (TrackingStoreError, SegmentStoreError) as exc:  # a store down at start: already redacted, with its fix
        err.print(f"[red]error:[/red] {escape(exc.problem)}\n[dim]fix:[/dim] {escape(exc.fix)}")
        return 1
    except typer.Exit as exc:
        return exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence: one line, not a traceback
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # usage errors (typer's vendored click)
            exc.show()
            return exc.exit_code
        if os.environ.get("FLEETLOOP_DEBUG"):
            raise
        err.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        err.print("[dim]fix:[/dim] follow the message above; set FLEETLOOP_DEBUG=1 to see the traceback")
        return 1


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
