"""The CLI's faces: --help everywhere, bad arguments as one line + fix + non-zero exit, --json."""

import json

import numpy as np
import pytest

from cli.main import app, main

NARROW = "80"  # COLUMNS: the terminal width the people view must fit

COMMANDS = sorted(cmd.name or cmd.callback.__name__ for cmd in app.registered_commands)


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "Usage" in capsys.readouterr().out


def test_train_node_outside_a_multi_host_run_is_one_line_with_fix(scratch_root, capsys):
    assert main(["train-node", "--node-rank", "1"]) == 1  # params.yaml says one host (distributed.nnodes: 1)
    out = capsys.readouterr().err
    assert "distributed.node_rank=1 must be below distributed.nnodes=1" in out and "fix:" in out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 2


def test_unknown_stage_is_one_line_with_fix(scratch_root, capsys):
    assert main(["stage", "bogus"]) == 1
    out = capsys.readouterr().err
    assert "unknown stage 'bogus'" in out and "fix:" in out and "collect, ingest, train, evaluate" in out
    assert "Traceback" not in out


def test_missing_files_are_refused(scratch_root, capsys):
    assert main(["ingest", str(scratch_root / "nope.parquet")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert not (scratch_root / "datasets" / "episodes").exists()  # nothing was written


def test_missing_argument_is_a_usage_error(capsys):
    assert main(["lineage"]) == 2
    assert "Missing argument" in capsys.readouterr().err


def test_import_of_a_non_lerobot_folder_is_refused(scratch_root, capsys):
    assert main(["import-lerobot", str(scratch_root)]) == 1
    assert "not a LeRobot v3 dataset" in capsys.readouterr().err


def test_rollback_without_history_and_unknown_lineage(scratch_root, capsys, prefect_harness):
    assert main(["rollback"]) == 1
    assert "nothing to roll back" in capsys.readouterr().err
    assert main(["lineage", "42"]) == 1
    assert "fleetloop status" in capsys.readouterr().err


def test_status_json_on_an_empty_root(scratch_root, capsys):
    assert main(["status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["champion"] is None
    assert status["data"]["episodes"] == 0 and status["data"]["segments"] == 0
    assert status["root"] == str(scratch_root.resolve())


def _squeezed(text: str) -> str:
    """Text without whitespace: a value folded over several lines of a table reads whole again."""
    return "".join(text.split())


def test_status_lineage_rollback_for_people_and_scripts(scratch_root, capsys, monkeypatch, prefect_harness):
    import torch

    from components.config import PolicyConfig, load_settings
    from components.policy.factory import make_policy
    from components.registry.lineage import Lineage
    from components.registry.model_registry import PolicyRegistry

    monkeypatch.setenv("COLUMNS", NARROW)
    settings = load_settings()
    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    torch.manual_seed(0)
    evaluation = {"success_rate": 0.75, "ci_low": 0.6, "ci_high": 0.85, "successes": 90, "trials": 120}
    lineage = Lineage(git_commit="abc", snapshot_hash="d41d8.dir", lancedb_version=3, params_hash="p", episodes=10, frames=100)
    version = registry.log_candidate(make_policy(6, 3, PolicyConfig(hidden=16, layers=2)), evaluation, lineage,
                                     {"train": {"lr": 0.001}}, {"loss": 0.1}, [1.0, 0.5], "run-status")
    assert registry.promote_if_better(version, None, None).promote

    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "{'" not in out and "'version'" not in out  # no Python dict repr
    assert out.splitlines()[-1].startswith(f"champion v{version.version} (75.0% success over 120 trials); 0 episodes")
    assert any(line.split() == ["champion.version", str(version.version)] for line in out.splitlines())
    assert "run-status" in out  # the last runs table
    assert all(len(line) <= int(NARROW) for line in out.splitlines()[:-1])

    assert main(["status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert set(status) == {"root", "champion", "aliases", "registry", "store", "last_runs", "data", "dataset_head"}
    assert status["store"] == {"uri": str(scratch_root.resolve() / "datasets" / "segments.lance"), "endpoint": None}
    assert status["dataset_head"] is None  # no DVC remote: the dataset lives under the root
    assert status["registry"]["tracking_uri"] == f"sqlite:///{scratch_root.resolve() / 'mlruns' / 'mlflow.db'}"
    assert status["champion"] == {"version": version.version, "success_rate": 0.75, "trials": 120}
    assert status["aliases"] == {"champion": version.version}

    assert main(["lineage", "champion"]) == 0
    out = capsys.readouterr().out
    assert "{'" not in out and any(line.split() == ["dvc_snapshot", "d41d8.dir"] for line in out.splitlines())
    assert out.splitlines()[-1].startswith(f"fleetloop-policy v{version.version}: run ")

    better = registry.log_candidate(make_policy(6, 3, PolicyConfig(hidden=16, layers=2)), {**evaluation, "success_rate": 0.99, "successes": 119},
                                    lineage, {"train": {"lr": 0.001}}, {"loss": 0.1}, [1.0, 0.5], "run-better")
    assert registry.promote_if_better(better, 90, 120).promote
    assert main(["rollback"]) == 0
    assert f"champion: {version.version}" in capsys.readouterr().out  # docs/operations.md's check, verbatim


def test_ingest_prints_quarantined_files_whole_at_80_columns(scratch_root, capsys, monkeypatch, prefect_harness):
    from components.episodes.schema import write_episode_file
    from components.fleet.local import synthetic_episode

    monkeypatch.setenv("COLUMNS", NARROW)
    good = write_episode_file(synthetic_episode("robot-0000", seed=1), scratch_root / "incoming" / "good.parquet")
    broken = synthetic_episode("robot-0001", seed=2)
    broken.actions[3, 1] = np.nan
    bad = write_episode_file(
        broken, scratch_root / "incoming" / "episode-from-robot-warehouse-east-aisle-0007-recorded-2026-12-01T06-00-00.parquet")

    assert main(["ingest", str(good), str(bad)]) == 0
    out = capsys.readouterr().out
    assert "['" not in out and "{'" not in out  # no Python list/dict repr
    assert _squeezed(str(bad)) in _squeezed(out)  # the path is folded over lines, never cut
    assert "NaN" in out and "fix" in out
    summary = out.splitlines()[-1]
    assert summary.startswith("ingest: 1 added (12 frames), 0 duplicates skipped, 1 quarantined; snapshot ")
    assert all(len(line) <= int(NARROW) for line in out.splitlines()[:-1])

    assert main(["ingest", "--json", str(good)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"added", "duplicates", "quarantined", "quarantined_total", "snapshot", "lancedb_version",
                           "segments_upserted"}
    assert (report["added"], report["duplicates"], report["quarantined"], report["quarantined_total"]) == (0, 1, [], 0)


def test_lerobot_import_and_export_for_people_scripts_and_errors(scratch_root, capsys, monkeypatch):
    from tests.test_lerobot import _write_lerobot_v3

    monkeypatch.setenv("COLUMNS", NARROW)
    at_30 = scratch_root / "so100-at-30fps"
    _write_lerobot_v3(at_30, fps=30)
    assert main(["import-lerobot", str(at_30), "--robot-id", "so100-lab", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["added"], report["duplicates"], report["quarantined"]) == (3, 0, [])
    assert (report["fps"], report["robot_type"]) == (30.0, "so100")  # the empty dataset adopted them

    assert main(["import-lerobot", str(at_30), "--robot-id", "so100-lab"]) == 0  # again, for people: nothing new
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"import {at_30}: 0 added (0 frames), 3 duplicates skipped, 0 quarantined"

    at_10 = scratch_root / "so100-at-10fps"
    _write_lerobot_v3(at_10, seed=4, fps=10)
    assert main(["import-lerobot", str(at_10)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()[-2:]  # after the progress line: error + fix
    assert lines[0].startswith("error: ") and "fps 10 differs from the dataset's 30" in lines[0], lines
    assert lines[1].startswith("fix: import into an empty dataset root")

    out_dir = scratch_root / "exported"
    assert main(["export-lerobot", str(out_dir), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported == {"path": str(out_dir), "episodes": 3, "frames": 12, "data_files": 1, "video_files": 2}
    assert main(["export-lerobot", str(out_dir)]) == 1  # never overwrites: one line + fix
    lines = capsys.readouterr().err.strip().splitlines()
    assert "export folder is not empty" in lines[0] and lines[1].startswith("fix: choose a new folder")


def test_evaluate_any_registered_model_on_fresh_test_robots(scratch_root, capsys, monkeypatch):
    """A tiny root through the product's own steps (demos -> ingest -> train -> register -> gate), then
    `fleetloop evaluate` on a fresh population: the model it loads by URI is the one registered."""
    from components.config import load_settings
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.evaluate import evaluate_on_test_robots, evaluate_policy
    from components.pipeline.ingest import ingest_files
    from components.pipeline.promote import gate_candidate, register_candidate
    from tests.conftest import small_settings

    for key, value in {"EVALUATION__TRIALS_PER_TASK": "6", "EVALUATION__TRIALS_PER_ROBOT": "2", "SEED": "0"}.items():
        monkeypatch.setenv(f"FLEETLOOP_{key}", value)
    settings = small_settings(scratch_root)
    ingest_files(settings, collect_expert_demos(settings, settings.paths.incoming / "expert").files, snapshot=False)
    outcome = steps.train_policy(settings)
    version = register_candidate(settings, outcome, evaluate_policy(settings, outcome.result.policy, "candidate"), "tiny")
    assert gate_candidate(settings, version, None).decision.promote

    args = ["--robots", "3", "--population-seed", "1004", "--json"]
    assert main(["evaluate", "--model-uri", f"models:/fleetloop-policy/{version.version}", *args]) == 0
    by_version = json.loads(capsys.readouterr().out)
    cli_settings = load_settings()  # what the command ran with: params.yaml + the env above
    direct = evaluate_on_test_robots(cli_settings, outcome.result.policy, "in-memory", 3, 1004)
    assert by_version["robots"] == ["test-0000", "test-0001", "test-0002"] and by_version["population_seed"] == 1004
    assert by_version["trials"] == 3 * cli_settings.evaluation.trials_for(3) == direct.overall.trials
    assert by_version["successes"] == direct.overall.successes
    assert by_version["by_robot"] == {r: {"successes": p.successes, "trials": p.trials} for r, p in direct.by_robot.items()}
    assert by_version["failures_by_stage"] == direct.failures_by_stage

    assert main(["evaluate", "--model-uri", "models:/fleetloop-policy@champion", *args]) == 0  # an alias: the same model
    assert {k: v for k, v in json.loads(capsys.readouterr().out).items() if k != "model_uri"} == {
        k: v for k, v in by_version.items() if k != "model_uri"}

    assert main(["evaluate", "--model-uri", "models:/fleetloop-policy@champion", "--robots", "2", "--population-seed", "7"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("models:/fleetloop-policy@champion on 2 test robots of population 7: ") and "thresholded" in summary

    assert main(["evaluate", "--model-uri", "models:/fleetloop-policy/99", *args]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert "cannot load model 'models:/fleetloop-policy/99'" in lines[0] and lines[1].startswith("fix: list versions")
    assert main(["evaluate", "--model-uri", "models:/fleetloop-policy/1", "--robots", "2"]) == 2  # the population is explicit
    assert "--population-seed" in capsys.readouterr().err

    monkeypatch.setenv("FLEETLOOP_SIM__NAME", "pack")  # a pick-place model in the pack simulator: said, not a torch error
    assert main(["evaluate", "--model-uri", f"models:/fleetloop-policy/{version.version}", *args]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert "takes 11-dim observations but sim.name=pack gives 17" in lines[0]
    assert lines[1] == "fix: evaluate it in the simulator it was trained in: FLEETLOOP_SIM__NAME=pickplace"


def test_demo_summary_names_the_champion_and_its_own_held_out_success():
    """The last line once paired the champion with the last (not promoted) challenger's figure."""
    import dataclasses

    from cli.main import demo_summary
    from flows.demo import RoundRow

    rows = [RoundRow("bootstrap", 4, 120, 1.0, "80.6% [76.9, 83.9]", 480, True, 1),
            RoundRow("round 1", 8, 171, 0.86, "85.6% [82.2, 88.5]", 480, True, 2),
            RoundRow("round 2", 8, 185, 0.92, "84.6% [81.1, 87.5]", 480, False, 2)]
    assert demo_summary(rows) == "demo: 3 rounds; champion v2 (promoted at round 1), held-out success 85.6% [82.2, 88.5]"
    assert demo_summary([dataclasses.replace(rows[0], promoted=False, champion=None)]) == "demo: 1 rounds; no champion"
