"""What `fleetloop status` and `fleetloop lineage` print: read from the registry, MLflow and the data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.config import Settings
from components.episodes.snapshot import read_snapshot
from components.pipeline.workspace import Workspace
from components.registry.tracking import redact_uri, tracking_store


class LineageNotFound(LookupError):
    pass


def status_report(settings: Settings, last_runs: int) -> dict[str, Any]:
    ws = Workspace(settings)
    store = ws.store  # the cheaper store first: one that is down fails before MLflow starts
    registry = ws.registry
    champion = registry.champion()
    runs = []
    if last_runs:
        client = registry.client
        for run in client.search_runs([registry.experiment_id], order_by=["attributes.start_time DESC"], max_results=last_runs):
            runs.append({
                "run": run.info.run_name, "run_id": run.info.run_id, "status": run.info.status,
                "success_rate": run.data.metrics.get("eval_success_rate"),
            })
    snapshot = read_snapshot(settings.paths.episodes)
    return {
        "root": str(settings.root),
        "champion": None if champion is None else {"version": champion.version, "success_rate": champion.success_rate, "trials": champion.trials},
        "aliases": registry.aliases(),
        "registry": registry_location(settings),
        "store": {"uri": ws.store_location.shown, "endpoint": ws.store_location.endpoint or None},
        "last_runs": runs,
        "data": {
            "episodes": ws.dataset.num_episodes, "frames": ws.dataset.num_frames, "robots": len(ws.dataset.robots()),
            "segments": store.count(), "lancedb_version": store.version,
            "snapshot": snapshot.hash if snapshot else None,
        },
        "dataset_head": dataset_head_report(settings, ws.dataset.num_episodes),
    }


def dataset_head_report(settings: Settings, local_episodes: int) -> dict[str, Any] | None:
    """With a DVC remote: its dataset head and where this root stands against it (dataset_head.py)."""
    if not settings.episodes.dvc_remote:
        return None
    from components.episodes.dataset_head import read_head, root_state
    from components.pipeline.ingest import dvc_remote

    head = read_head(dvc_remote(settings))
    return {"remote": redact_uri(settings.episodes.dvc_remote), "snapshot": head.snapshot if head else None,
            "episodes": head.episodes if head else None,
            "this_root": root_state(head, settings.paths.episodes, local_episodes)}


def registry_location(settings: Settings) -> dict[str, str]:
    """Where the registry lives, as people may see it: passwords redacted."""
    store = tracking_store(settings.paths.mlruns, settings.registry)
    return {"tracking_uri": store.shown,
            "artifact_uri": redact_uri(store.artifact_location) if store.artifact_location else "the tracking server's default"}


def status_summary(report: dict[str, Any]) -> str:
    """One line for people: the champion and the data size."""
    champion = report["champion"]
    if champion is None:
        head = "no champion yet"
    elif champion["success_rate"] is None:
        head = f"champion v{champion['version']} (not evaluated)"
    else:
        head = f"champion v{champion['version']} ({100 * champion['success_rate']:.1f}% success over {champion['trials']} trials)"
    data = report["data"]
    line = (f"{head}; {data['episodes']} episodes, {data['frames']} frames, {data['robots']} robots, "
            f"{data['segments']} segments")
    remote = report.get("dataset_head")
    if remote and remote["snapshot"]:
        line += f"; dataset head {remote['snapshot'][:12]} ({remote['episodes']} episodes), this root {remote['this_root']}"
    return line


def lineage_summary(report: dict[str, Any]) -> str:
    commit = (report["git_commit"] or "?")[:12]
    return (f"{report['model']}: run {report['mlflow_run']['id']}, commit {commit}, snapshot {report['dvc_snapshot']}, "
            f"lancedb version {report['lancedb_version']}, {report['episodes']} episodes")


def lineage_report(settings: Settings, version: str) -> dict[str, Any]:
    registry = Workspace(settings).registry
    number = int(version) if version.isdigit() else registry.aliases().get(version)
    if number is None:
        raise LineageNotFound(f"no model version or alias {version!r} in {settings.registry.model_name}")
    try:
        mv = registry.get_version(number)
    except Exception as exc:  # noqa: BLE001 - MlflowException: RESOURCE_DOES_NOT_EXIST
        raise LineageNotFound(f"model version {number} of {settings.registry.model_name} does not exist") from exc
    run = registry.client.get_run(mv.run_id)
    lin = mv.lineage
    return {
        "model": f"{mv.name} v{mv.version}",
        "aliases": [alias for alias, v in registry.aliases().items() if v == mv.version],
        "evaluation": {"successes": mv.successes, "trials": mv.trials, "success_rate": mv.success_rate},
        "mlflow_run": {"id": run.info.run_id, "name": run.info.run_name, "experiment_id": run.info.experiment_id},
        "git_commit": lin.git_commit,
        "params": {k: v for k, v in sorted(run.data.params.items()) if k.split(".")[0] in ("seed", "train", "policy", "fert")},
        "params_hash": lin.params_hash,
        "dvc_snapshot": lin.snapshot_hash,
        # where the snapshot lives besides the root's DVC cache, and how to get exactly it back
        "dvc_remote": lin.snapshot_remote or None,
        "restore": (f"fleetloop reproduce {mv.version} --scratch DIR (DIR/datasets/episodes: the snapshot, "
                    f"pulled from {lin.snapshot_remote or 'the DVC cache'})" if lin.recipe else
                    f"write {{outs: [{{md5: {lin.snapshot_hash}, hash: md5, path: episodes}}]}} to datasets/episodes.dvc, "
                    f"then `dvc {'pull -r fleetloop' if lin.snapshot_remote else 'checkout'} datasets/episodes.dvc`"),
        "lancedb_version": lin.lancedb_version,
        "episodes": lin.episodes,
        "frames": lin.frames,
        "episodes_per_robot": lin.episodes_per_robot,
        "champion_when_trained": lin.champion_version if lin.champion_version >= 0 else None,
        "recipe": lin.recipe or None,  # "train-task": `fleetloop reproduce` rebuilds it
    }


def evaluation_report(settings: Settings, model_uri: str, robots: int, population_seed: int) -> dict[str, Any]:
    """`fleetloop evaluate`: a registered model on ``robots`` test robots of ``population_seed``."""
    from components.pipeline.evaluate import evaluate_on_test_robots

    policy = Workspace(settings).registry.load_uri(model_uri)
    report = evaluate_on_test_robots(settings, policy, model_uri, robots, population_seed)
    result = report.to_dict()
    result.pop("policy_version")
    return {"model_uri": model_uri, "population_seed": population_seed, "robots": report.robots,
            "jaw": "sampled" if settings.evaluation.sample_gripper else "thresholded", **result}


def evaluation_summary(report: dict[str, Any]) -> str:
    return (f"{report['model_uri']} on {len(report['robots'])} test robots of population {report['population_seed']}: "
            f"{100 * report['success_rate']:.1f}% [{100 * report['ci_low']:.1f}, {100 * report['ci_high']:.1f}] "
            f"over {report['trials']} trials ({report['jaw']} jaw)")


def explain_report(settings: Settings, version: str, out_dir: Path | None) -> dict[str, Any]:
    """`fleetloop explain`: the failure explorer's pictures for a version, and its stage table."""
    from components.pipeline.explain import explain_version

    number = Workspace(settings).registry.resolve(version).version
    explained = explain_version(settings, number, out_dir)
    root = Path(explained.out_dir).resolve()
    return {
        "version": number, "method": explained.method, "out_dir": str(root),
        "failures": explained.failures, "matches": explained.matches,
        "pages": [{"group": p.group, "key": p.key, "path": str(root / p.path), "failures_shown": len(p.failures_shown),
                   "failures_total": p.failures_total} for p in explained.pages],
        "stage_table": explained.stage_table.to_dict(),
        "files": [str(root / f) for f in explained.files],
        "robots_left_out": explained.robots_left_out,
    }


def explain_summary(report: dict[str, Any]) -> str:
    table = report["stage_table"]
    after = "not evaluated" if table["after_trials"] is None else f"{table['after_trials']} evaluation trials"
    return (f"explain v{report['version']} ({report['method']}): {report['failures']} failures, {report['matches']} retrieved "
            f"windows, {len(report['pages'])} pages in {report['out_dir']}; stage table over {table['before_episodes']} "
            f"fleet episodes before, {after} after")
