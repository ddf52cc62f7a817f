"""The failure explorer on real Prefect, MLflow (SQLite), LanceDB and DVC in a scratch root: a FERT
round through the retrain flow leaves its pictures on the run, `fleetloop explain` draws the same
ones, and the stage table counts what the episodes did."""

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np

from cli.main import main
from components.config import TrainConfig
from components.episodes.record import STAGE_COLUMN
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos, collect_fleet
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import ingest_files
from components.pipeline.promote import gate_candidate, register_candidate
from components.pipeline.workspace import Workspace
from components.sim.pickplace import STAGES
from tests.conftest import small_settings

TRAIN = {"epochs": 2, "batch_size": 64, "steps_per_iteration": 10, "validation_robots": 0}


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_fert_round_is_explained_by_the_flow_and_the_command(tmp_path, monkeypatch, capsys, prefect_harness):
    from prefect.artifacts import Artifact

    from flows.retrain import retrain

    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # the first champion: BC on scripted-expert demos (the product's bootstrap, without the flow)
    boot = small_settings(tmp_path, train=TrainConfig(method="bc", **TRAIN))
    ingest_files(boot, collect_expert_demos(boot, boot.paths.incoming / "expert").files, snapshot=False)
    trained = steps.train_policy(boot)
    first = register_candidate(boot, trained, evaluate_policy(boot, trained.result.policy, "candidate"), "bootstrap")
    assert gate_candidate(boot, first, None).decision.promote

    # one fleet round of the champion, retrained with FERT by the retrain flow
    settings = small_settings(tmp_path, train=TrainConfig(method="fert", **TRAIN))
    registry = Workspace(settings).registry
    fleet = collect_fleet(settings, registry.load(first.version), f"v{first.version}",
                          settings.paths.incoming / "round-001", round_index=1)
    assert fleet.episodes > fleet.successes  # failures to explain
    promotion = retrain(fleet.files, "round-1", settings)
    version = promotion.candidate
    assert version.tags["fleetloop.method"] == "fert"

    # the flow logged the explorer onto the run, and told the Prefect UI where it is
    logged = {a.path for a in registry.client.list_artifacts(version.run_id, "explain")}
    assert {"explain/index.json", "explain/stage_failures.csv", "explain/stage_failures.png", "explain/by-robot",
            "explain/by-stage"} <= logged

    markdown = Artifact.get("failure-explorer")
    assert markdown is not None and "| stage | failed in the fleet's data" in markdown.data and "explain/" in markdown.data
    assert "| champion before (" in markdown.data

    # the command draws the same pictures from the version's run and training data
    out = tmp_path / "explained"
    assert main(["explain", str(version.version), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"version", "method", "out_dir", "failures", "matches", "pages", "stage_table", "files",
                           "robots_left_out"}
    pngs = [f for f in report["files"] if f.endswith(".png")]
    assert len(pngs) >= 3 and all(Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in pngs)
    assert {p["group"] for p in report["pages"]} == {"robot", "stage"}
    from_run = Path(registry.client.download_artifacts(version.run_id, "explain", str(tmp_path / "from-run")))
    assert _digests(out) == _digests(from_run)  # byte for byte what the flow logged

    # the stage table counts what the episodes did, before (the fleet's episodes it trained on) ...
    episodes = list(Workspace(settings).dataset.episodes())
    fleet_eps = [ep for ep in episodes if ep.policy_version != "expert"]
    before = Counter(STAGES[int(np.max(ep.extras[STAGE_COLUMN]))] for ep in fleet_eps if not ep.success)
    rows = {r["stage"]: r for r in report["stage_table"]["rows"]}
    assert report["stage_table"]["before_episodes"] == len(fleet_eps)
    assert {s: r["before_failures"] for s, r in rows.items() if r["before_failures"]} == dict(before)
    assert sum(r["queried_failures"] for r in rows.values()) == report["failures"] == sum(before.values())
    # ... and after (the candidate's evaluation rollouts, rolled out again here: seeded, the same trials)
    again = evaluate_policy(settings, registry.load(version.version), "candidate")
    assert report["stage_table"]["after_trials"] == again.overall.trials
    assert {s: r["after_failures"] for s, r in rows.items() if r["after_failures"]} == again.failures_by_stage
    # ... and like for like before it: the champion on those same trials (the gate's paired evaluation)
    champion = evaluate_policy(settings, registry.load(first.version), f"v{first.version}")
    assert report["stage_table"]["champion_trials"] == champion.overall.trials == again.overall.trials
    assert {s: r["champion_failures"] for s, r in rows.items() if r["champion_failures"]} == champion.failures_by_stage
    assert sum(r["champion_failures"] for r in rows.values()) == champion.overall.trials - champion.overall.successes
    csv_rows = (out / "stage_failures.csv").read_text().splitlines()
    assert csv_rows[0].startswith("stage,before_failures") and len(csv_rows) == 1 + len(rows)

    # a version trained without retrieval: one line and the fix
    assert main(["explain", str(first.version)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"error: version {first.version} was trained with method bc: no retrieval to explain"
    assert lines[1].startswith("fix: explain a version trained with train.method fert")
