"""`fleetloop fleet ...` end to end: tokens, revoke, up --detach, status, down (no process left)."""

from __future__ import annotations

import json
import stat
import time

import pytest
from typer.testing import CliRunner

from components.fleet.auth import read_token_file
from components.fleet.coordinator import Coordinator
from components.fleet.layout import RuntimeLayout
from components.fleet.local import free_port
from components.fleet.processes import pid_alive
from components.config import load_settings
from cli.fleet import fleet_app

runner = CliRunner()


def _env(monkeypatch, root):
    monkeypatch.setenv("FLEETLOOP_ROOT", str(root))
    monkeypatch.setenv("FLEETLOOP_FLEET__NUM_ROBOTS", "2")
    monkeypatch.setenv("FLEETLOOP_DEVICE", "cpu")
    for key in ("INGEST_PORT", "INFERENCE_PORT", "COORDINATOR_PORT"):
        monkeypatch.setenv(f"FLEETLOOP_RUNTIME__{key}", str(free_port()))


def test_tokens_and_revoke_never_print_a_token(tmp_path, monkeypatch):
    _env(monkeypatch, tmp_path)
    issued = runner.invoke(fleet_app, ["tokens"])
    assert issued.exit_code == 0, issued.output
    path = RuntimeLayout.of(load_settings()).token_file
    book = read_token_file(path)
    assert set(book.robots) == {"robot-0000", "robot-0001"} and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not any(t in issued.output for t in [*book.robots.values(), book.service])
    assert (tmp_path / "fleet-runtime" / ".gitignore").read_text().strip().endswith("*")
    revoked = runner.invoke(fleet_app, ["revoke", "robot-0001", "--json"])
    assert revoked.exit_code == 0 and "robot-0001" not in read_token_file(path).robots
    assert json.loads(revoked.stdout) == {"revoked": "robot-0001"}
    again = runner.invoke(fleet_app, ["tokens", "--json"])  # a revoke stays revoked: no new token
    assert json.loads(again.stdout) == {"robots": 1, "token_file": str(path), "rotated": False,
                                        "revoked_robots": ["robot-0001"]}
    assert not any(t in again.stdout for t in [*read_token_file(path).robots.values(), book.service])
    supervised = Coordinator(load_settings())  # `fleet up` would not start the revoked robot's agent
    assert "robot-0001" not in supervised.members and "robot-0000" in supervised.members
    assert supervised.status()["revoked"] == ["robot-0001"]
    twice = runner.invoke(fleet_app, ["revoke", "robot-0001"])
    assert twice.exit_code == 1 and "--readmit robot-0001" in twice.stderr
    readmitted = runner.invoke(fleet_app, ["tokens", "--readmit", "robot-0001", "--json"])
    assert json.loads(readmitted.stdout)["robots"] == 2 and json.loads(readmitted.stdout)["revoked_robots"] == []
    assert read_token_file(path).robots["robot-0001"] != book.robots["robot-0001"]  # a new token, not the old one
    unknown = runner.invoke(fleet_app, ["revoke", "robot-0042"])
    assert unknown.exit_code == 1 and unknown.stderr.count("\n") == 2 and "fix:" in unknown.stderr  # one line + fix


def test_up_status_down_leaves_no_process(tmp_path, monkeypatch):
    _env(monkeypatch, tmp_path)
    started = runner.invoke(fleet_app, ["up", "--detach", "--episodes", "1"])
    assert started.exit_code == 0, started.output
    layout = RuntimeLayout.of(load_settings())
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if layout.status_file.exists():
                members = json.loads(layout.status_file.read_text())["members"]
                pids = {m["pid"] for m in members.values() if m["pid"]}
                if len(pids) == 5:
                    break
            time.sleep(0.2)
        status = runner.invoke(fleet_app, ["status", "--json"])
        body = json.loads(status.output)
        assert body["coordinator_running"] and set(body["members"]) == {"ingest", "inference", "trainer", "robot-0000", "robot-0001"}
        pids.add(int(json.loads(layout.coordinator_pid_file.read_text())["pid"]))
        assert runner.invoke(fleet_app, ["up", "--detach"]).exit_code == 1  # already up
    finally:
        stopped = runner.invoke(fleet_app, ["down"])
    assert stopped.exit_code == 0, stopped.output
    time.sleep(0.5)
    assert len(pids) == 6 and not [p for p in pids if pid_alive(p) and _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.slow
def test_fleet_up_trainer_ships_a_champion_and_status_shows_the_version_each_robot_serves(tmp_path, monkeypatch):
    """No Prefect run: the fleet trainer's checkpoint becomes @champion, inference hot-swaps to it and
    every robot reports acting with it. The root holds stored episodes but no model at all, so the
    robots hold still until the trainer's first candidate passes the gate ("no champion yet")."""
    from components.episodes.dataset import EpisodeDataset
    from components.fleet.local import synthetic_episode
    from components.fleet.shipping import SOURCE, SOURCE_TAG, STEP_TAG
    from components.fleet.trainer import STATUS_NAME
    from components.fleet.training_set import TAG_PREFIX
    from components.pipeline.workspace import Workspace
    from components.registry.model_registry import PolicyRegistry

    _env(monkeypatch, tmp_path)
    small = {
        "RUNTIME__CANDIDATE_EVERY_STEPS": "20", "RUNTIME__CHECKPOINT_EVERY": "10", "RUNTIME__TRAINER_BATCH_SIZE": "16",
        "RUNTIME__ALIAS_POLL_S": "0.5", "RUNTIME__HEARTBEAT_S": "0.25", "RUNTIME__STOP_GRACE_S": "3",
        "EVALUATION__TRIALS_PER_TASK": "4", "EVALUATION__TRIALS_PER_ROBOT": "2", "FLEET__NUM_HELDOUT_ROBOTS": "2",
        "SIM__MAX_STEPS": "30",
    }
    for key, value in small.items():
        monkeypatch.setenv(f"FLEETLOOP_{key}", value)
    settings = load_settings()
    EpisodeDataset(settings.paths.episodes, settings.episodes).add_episodes(
        [synthetic_episode(f"robot-{i % 2:04d}", seed=i, length=10) for i in range(12)]
    )
    layout = RuntimeLayout.of(settings)
    started = runner.invoke(fleet_app, ["up", "--detach"])
    assert started.exit_code == 0, started.output
    up_at = time.monotonic()
    body: dict = {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            status = runner.invoke(fleet_app, ["status", "--json"])
            body = json.loads(status.stdout) if status.exit_code == 0 else {}
            champion = body.get("aliases", {}).get("champion")
            serving = body.get("serving", {})
            if champion and set(serving) == {"robot-0000", "robot-0001"} and set(serving.values()) == {f"v{champion}"}:
                break
            time.sleep(0.5)
        seen_after_s = time.monotonic() - up_at
        table = runner.invoke(fleet_app, ["status"])
        trainer = json.loads((layout.state / STATUS_NAME).read_text())
    finally:
        stopped = runner.invoke(fleet_app, ["down"])
    assert stopped.exit_code == 0, stopped.output
    champion = body["aliases"]["champion"]
    assert body["serving"] == {"robot-0000": f"v{champion}", "robot-0001": f"v{champion}"}, body
    assert f"v{champion}" in table.output  # the human table's "serves" column
    version = PolicyRegistry(settings.paths.mlruns, settings.registry).get_version(champion)
    assert version.tags[SOURCE_TAG] == SOURCE and int(version.tags[STEP_TAG]) % 20 == 0  # the trainer's checkpoint
    # trained with FERT (the default train.method) on a store version the trainer pinned (and tagged)
    assert version.tags["fleetloop.method"] == "fert" and trainer["training_set"]["method"] == "fert"
    pinned = Workspace(settings).store.tags()
    assert pinned[f"{TAG_PREFIX}{version.lineage.lancedb_version}"] == version.lineage.lancedb_version
    assert trainer["candidates"]["shipped"] >= 1 and trainer["candidates"]["promoted"] >= 1
    print(json.dumps({"champion": champion, "serving": body["serving"], "seen_after_s": round(seen_after_s, 1),
                      "last_candidate": trainer["candidates"]["last"]}))


def _long_named_status(root, monkeypatch) -> tuple[list[str], str]:
    """A status.json as the coordinator writes it, for members with long names (no fleet runs)."""
    _env(monkeypatch, root)
    names = ["ingest", "inference", "trainer", "robot-warehouse-east-aisle-0007", "robot-warehouse-east-aisle-0012"]
    served = "models:/fleetloop-policy/17"
    members = {
        name: {"role": "robot" if name.startswith("robot") else name, "pid": 4000 + i, "identity": None,
               "alive": True, "failures": 0, "restart_in_s": None, "done": False, "restarts": i,
               "last_exit": None, "heartbeat_age_s": 0.25 * i,
               "info": {"serving": "v17", "episodes": 3, "spool": f"/var/lib/fleetloop/spool/{name}/pending"}}
        for i, name in enumerate(names)
    }
    body = {"coordinator_pid": 1, "members": members, "robots_done": 0, "robots": 2, "served": {"champion": served},
            "serving": {n: "v17" for n in names if n.startswith("robot")}, "aliases": {"champion": 17, "previous": 16},
            "canary": {}, "time": 0.0}
    path = RuntimeLayout.of(load_settings()).status_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    return names, served


def test_status_table_keeps_member_names_whole_at_80_columns(tmp_path, monkeypatch):
    names, served = _long_named_status(tmp_path, monkeypatch)
    result = CliRunner(env={"COLUMNS": "80"}).invoke(fleet_app, ["status"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    table_lines = lines[:-1]
    assert all(len(line) <= 80 for line in table_lines), "\n".join(lines)
    for name in names:
        assert any(name in line for line in table_lines), f"{name} cut:\n{result.stdout}"
    for line in table_lines:  # each member's spool path is folded, never cut with an ellipsis
        assert "…" not in line
    summary = lines[-1]
    assert summary.startswith("fleet down: 0/5 members alive, 0/2 robots done; champion v17, previous v16")
    assert served in summary and "{" not in summary  # no Python repr


def test_status_json_keys_are_stable(tmp_path, monkeypatch):
    _long_named_status(tmp_path, monkeypatch)
    body = json.loads(CliRunner(env={"COLUMNS": "80"}).invoke(fleet_app, ["status", "--json"]).stdout)
    assert {"members", "served", "serving", "aliases", "canary", "coordinator_running", "orphans"} <= set(body)
    assert body["coordinator_running"] is False and body["orphans"] == []
    assert body["members"]["robot-warehouse-east-aisle-0007"]["info"]["serving"] == "v17"
