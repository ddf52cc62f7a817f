"""The `fleetloop` command: the face over flows and stages (typer + rich)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="fleetloop: turn a robot fleet's own executions into a better shared policy.", no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _settings():
    from flows.settings import prepare_environment

    return prepare_environment()


def _fail(message: str, fix: str) -> None:
    err.print(f"[red]error:[/red] {message}\n[dim]fix:[/dim] {fix}")
    raise typer.Exit(code=1)


@app.command()
def demo() -> None:
    """Bootstrap from scripted-expert demos, then run fleet rounds on @champion; print a per-round table."""
    settings = _settings()
    from flows.demo import demo as demo_flow

    rows = demo_flow(settings)
    table = Table(title=f"fleetloop demo: closed-loop rounds (held-out success, Wilson {100 * settings.evaluation.confidence:.0f}% CI)")
    for col in ("round", "robots", "episodes", "fleet success", "held-out success [CI]", "trials", "promoted", "champion"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(
            r.round, str(r.robots), str(r.episodes), f"{100 * r.collected_success:.1f}%", r.heldout, str(r.trials),
            "yes" if r.promoted else "no", f"v{r.champion}",
        )
    Console(width=max(console.width, 120)).print(table)


@app.command()
def ingest(files: Annotated[list[Path], typer.Argument(help="Episode files (Parquet or Arrow IPC).")], as_json: JsonOpt = False) -> None:
    """Validate and ingest episode files; bad files go to quarantine with a reason."""
    settings = _settings()
    from components.pipeline.steps import ingest_files

    missing = [str(f) for f in files if not f.exists()]
    if missing:
        _fail(f"no such file: {', '.join(missing)}", "pass existing episode files (one Parquet file per episode)")
    result = ingest_files(settings, files)
    summary = {
        "added": len(result.report.added), "duplicates": len(result.report.duplicates),
        "quarantined": [str(q) for q in result.report.quarantined],
        "snapshot": result.snapshot.hash if result.snapshot else None, "lancedb_version": result.store_version,
    }
    console.print_json(json.dumps(summary)) if as_json else console.print(summary)


@app.command()
def retrain(
    files: Annotated[Optional[list[Path]], typer.Argument(help="New episode files to ingest first.")] = None,
    bootstrap: Annotated[bool, typer.Option(help="Collect scripted-expert demos first.")] = False,
) -> None:
    """Run the retrain flow: ingest → train → evaluate → register → promote."""
    settings = _settings()
    if bootstrap:
        from flows.fleet_round import bootstrap as bootstrap_flow

        _, promotion = bootstrap_flow(settings)
    else:
        from flows.retrain import retrain as retrain_flow

        promotion = retrain_flow(settings, list(files or []))
    console.print(f"version {promotion.candidate.version}: {promotion.decision.reason}")


@app.command("import-lerobot")
def import_lerobot(
    src: Annotated[Path, typer.Argument(help="A LeRobot v3 dataset folder (meta/info.json inside).")],
    robot_id: Annotated[str, typer.Option(help="Robot id for episodes that carry none.")] = "lerobot-import",
) -> None:
    """Import a LeRobot v3 dataset into the episode dataset."""
    settings = _settings()
    from components.episodes.lerobot import import_lerobot as do_import
    from components.pipeline.workspace import Workspace

    if not (src / "meta" / "info.json").exists():
        _fail(f"{src} is not a LeRobot v3 dataset (no meta/info.json)", "point at the dataset root folder that contains meta/ and data/")
    report = do_import(src, Workspace(settings).dataset, robot_id=robot_id)
    console.print(report)


@app.command("export-lerobot")
def export_lerobot(dst: Annotated[Path, typer.Argument(help="Folder to write the LeRobot v3 dataset into.")]) -> None:
    """Export the episode dataset in the LeRobot v3 layout."""
    settings = _settings()
    from components.episodes.lerobot import export_lerobot as do_export
    from components.pipeline.workspace import Workspace

    do_export(Workspace(settings).dataset, dst)
    console.print(f"exported to {dst}")


@app.command()
def rollback() -> None:
    """Restore the previous champion (alias `previous` → `champion`)."""
    settings = _settings()
    from components.pipeline.workspace import Workspace
    from components.registry.model_registry import RegistryError

    try:
        restored = Workspace(settings).registry.rollback()
    except RegistryError as exc:
        _fail(str(exc), "promote at least two models before rolling back")
    console.print(f"champion is now version {restored.version}")


@app.command()
def stage(name: Annotated[str, typer.Argument(help="collect | ingest | train | evaluate")]) -> None:
    """Run one dvc.yaml stage (what `dvc repro` calls)."""
    from components.pipeline.dvc_stages import STAGES, run_stage

    if name not in STAGES:
        _fail(f"unknown stage {name!r}", f"use one of: {', '.join(STAGES)}")
    run_stage(name, _settings())


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
