"""The closed loop on a team's stores, across two hosts that share no disk (issue 18).

Every server is real and started by the tests on loopback: Postgres + an MLflow tracking server
(runs, registry), an S3 API (MLflow artifacts, the DVC remote that holds the episode dataset, the
LanceDB segment store) and a Prefect server. Host A bootstraps in this process. Host B is a Prefect
process worker started with `prefect worker start` in its own empty folder, as docs/deploy.md adds
a worker host: it runs a fleet round from the work pool (the dataset comes from the remote's head,
the champion from the registry), and its candidate is promoted. Then the champion is rolled back
from host A, host A's next ingest fast-forwards to host B's data, host B's folder is deleted, and
host B's model is rebuilt bit-identically from a third, fresh root: nothing it needed was on its disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from cli.main import main
from components.config import TrainConfig
from components.pipeline.ingest import ingest_files
from components.pipeline.recipe import public_settings
from components.pipeline.workspace import Workspace
from tests.conftest import small_settings
from tests.servers import ARTIFACT_BUCKET, registry_env, store_env

REPO = Path(__file__).resolve().parent.parent
POOL = "fleetloop-process"  # prefect.yaml's work pool
ROUND_DEPLOYMENT = "fleet_round/fleet-round"
DVC_PREFIX = "team-dvc"
WORKER_TIMEOUT_S = 900  # the round's flow run, from the moment it is created
WORKER_POLL_S = 1  # the worker's query interval (Prefect's default is 10 s) and ours
PREFECT_CLI_TIMEOUT_S = 300
STOP_GRACE_S = 30
# what a host may keep under its root: caches and the checkout of the remote's dataset head
# (artifacts/: local copies of what the MLflow run holds: schedule plots, the failure explorer's pages)
CACHE_PATHS = (".dvc", ".dvcignore", ".prefect", ".fleetloop", "params.yaml", "artifacts", "datasets/episodes",
               "datasets/episodes.dvc", "datasets/episodes.head.json", "datasets/incoming")


def _team_env(mlflow_server, s3_server) -> dict[str, str]:
    return {**registry_env(mlflow_server, s3_server), **store_env(s3_server, prefix="team-segments"),
            "FLEETLOOP_EPISODES__DVC_REMOTE": f"s3://{ARTIFACT_BUCKET}/{DVC_PREFIX}",
            "FLEETLOOP_EPISODES__DVC_REMOTE_ENDPOINT": s3_server.endpoint,
            "FLEETLOOP_REGISTRY__EXPERIMENT": "team-loop", "FLEETLOOP_REGISTRY__MODEL_NAME": "team-policy",
            "FLEETLOOP_REGISTRY__GATE_ALPHA": "1.0"}  # every challenger passes: test_gate tests the statistics


def _host_root(path: Path, settings) -> Path:
    """A host's root holds only its params.yaml (no stores: those come from the environment)."""
    path.mkdir(parents=True)
    (path / "params.yaml").write_text(yaml.safe_dump(public_settings(settings)))
    return path


def _prefect_command(api: str, *args: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([str(Path(sys.executable).parent / "prefect"), *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **env, "PREFECT_API_URL": api})


def _finish(proc: subprocess.Popen, what: str, timeout: float = PREFECT_CLI_TIMEOUT_S) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what}:\n{out[-4000:]}"
    return out


@contextmanager
def _worker_host(api: str, host_b: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """`prefect worker start --pool fleetloop-process` in host B's own empty folder, configured by
    its environment alone, as docs/deploy.md adds a worker host; stopped (SIGINT) on exit."""
    worker_env = {**env, "FLEETLOOP_ROOT": str(host_b), "FLEETLOOP_REPO": str(REPO),
                  "PREFECT_HOME": str(host_b / ".prefect"), "PREFECT_WORKER_QUERY_SECONDS": str(WORKER_POLL_S)}
    worker = _prefect_command(api, "worker", "start", "--pool", POOL, "--type", "process", cwd=host_b, env=worker_env)
    try:
        yield worker
    finally:
        os.killpg(worker.pid, signal.SIGINT)
        try:
            worker.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def _deploy(api: str) -> subprocess.Popen:
    """`make deploy`: prefect.yaml's deployments (the pool exists already)."""
    return _prefect_command(api, "--no-prompt", "deploy", "--all", cwd=REPO, env={"FLEETLOOP_REPO": str(REPO)})


def _run_round_on_the_pool(worker: subprocess.Popen):
    """One fleet round from the deployment (schedules paused: only this run reaches the worker)."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    with get_client(sync_client=True) as client:
        for name in ("nightly-retrain", "fleet-round"):
            client.pause_deployment(next(d.id for d in client.read_deployments() if d.name == name))
        run = run_deployment(ROUND_DEPLOYMENT, timeout=0)
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not run.state.is_final() and time.monotonic() < deadline:
            assert worker.poll() is None, f"the worker exited ({worker.returncode})"
            time.sleep(WORKER_POLL_S)
            run = client.read_flow_run(run.id)
        return run


def _outside_caches(root: Path) -> list[str]:
    files = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in files if not any(f == c or f.startswith(c + "/") for c in CACHE_PATHS))


@pytest.mark.slow
def test_closed_loop_on_remote_stores_with_a_second_worker_host(tmp_path, monkeypatch, capsys, prefect_harness,
                                                               mlflow_server, s3_server):
    from prefect.settings import PREFECT_API_URL

    from flows.fleet_round import bootstrap

    env = _team_env(mlflow_server, s3_server)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings_a = small_settings(tmp_path / "host-a", train=TrainConfig(method="fert", epochs=3, batch_size=64,
                                                                       steps_per_iteration=10, validation_robots=1))
    host_a, host_b = _host_root(settings_a.root, settings_a), _host_root(tmp_path / "host-b", settings_a)
    api = PREFECT_API_URL.value()
    _finish(_prefect_command(api, "work-pool", "create", POOL, "--type", "process", cwd=REPO, env={}), "work-pool create")
    with _worker_host(api, host_b, env) as worker:
        deploying = _deploy(api)  # the worker starts and the deployments land while host A bootstraps
        _, first = bootstrap(settings_a)
        assert first.decision.promote and first.champion_after == first.candidate.version
        _finish(deploying, "prefect deploy --all")
        run = _run_round_on_the_pool(worker)
    assert run.state.is_completed(), f"{run.state}\n{worker.stdout.read()[-4000:]}"

    registry = Workspace(settings_a).registry  # host A sees host B's model through the tracking server
    second = registry.champion()
    assert second.version == first.candidate.version + 1 and second.lineage.champion_version == first.candidate.version
    head = second.lineage.snapshot_hash
    assert (host_b / "datasets" / "episodes.dvc").read_text().count(head) == 1  # B trained on the head it published
    assert _outside_caches(host_a) == [] and _outside_caches(host_b) == []

    monkeypatch.setenv("FLEETLOOP_ROOT", str(host_a))
    capsys.readouterr()
    assert main(["rollback", "--json"]) == 0 and json.loads(capsys.readouterr().out)["champion"] == first.candidate.version
    assert main(["status", "--json", "--runs", "0"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["dataset_head"]["snapshot"] == head and status["dataset_head"]["this_root"] == "behind"
    assert status["champion"]["version"] == first.candidate.version
    assert ingest_files(settings_a, []).snapshot.hash == head  # host A fast-forwards to B's data
    assert Workspace(settings_a).dataset.num_episodes == second.lineage.episodes

    shutil.rmtree(host_b)  # lose host B: its model is rebuilt from the stores alone, in a fresh root
    host_c = _host_root(tmp_path / "host-c", settings_a)
    monkeypatch.setenv("FLEETLOOP_ROOT", str(host_c))
    assert main(["reproduce", str(second.version), "--json", "--scratch", str(tmp_path / "scratch")]) == 0
    rebuilt = json.loads(capsys.readouterr().out)
    assert rebuilt["matches"] and rebuilt["snapshot"] == head and rebuilt["store_version"] is not None, rebuilt
