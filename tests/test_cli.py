"""The CLI's faces: --help everywhere, bad arguments as one line + fix + non-zero exit, --json."""

import json

import pytest

from cli.main import app, main

COMMANDS = sorted(cmd.name or cmd.callback.__name__ for cmd in app.registered_commands)


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "Usage" in capsys.readouterr().out


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
