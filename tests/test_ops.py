"""Operations against a real Prefect server on a loopback port: runs + artifacts read back through
the client, a killed flow re-run from its cached tasks, and fan-out on a 2-process Dask cluster and
on a local 2-CPU Ray cluster."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, TaskRunFilter, TaskRunFilterName
from prefect.settings import PREFECT_API_URL, temporary_settings

from components.config import OpsConfig
from components.pipeline.references import load_candidate
from cli.services import _wait, start_prefect_server
from tests.conftest import small_settings

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free loopback port, its own home; yields the API URL."""
    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    settings = small_settings(home, ops=OpsConfig(prefect_port=port))
    old_home = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(home / ".prefect")
    try:
        proc = start_prefect_server(settings, port)
    finally:
        os.environ["PREFECT_HOME"] = old_home or ""
    api = f"http://127.0.0.1:{port}/api"
    try:
        assert _wait(f"{api}/health", 120), "Prefect server did not become healthy"
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield api
    finally:
        _drain_prefect_workers()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _drain_prefect_workers() -> None:
    """Deliver (and stop) the event and log workers while this server still runs. They keep the API
    client they started with, so later tests' events would otherwise go to the killed server and the
    session's final drain would wait on each one (seen: test_ops before test_retrain_flow hung at exit)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        worker.drain_all(timeout=60)


def _flow_run(client, name: str):
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=None), limit=200)
    return [r for r in runs if r.name and r.flow_id and client.read_flow(r.flow_id).name == name]


def _check_retrain_run_and_artifacts(client, started: datetime, version: int) -> None:
    """The one retrain flow run completed since ``started`` is recorded on the server with its
    artifacts: the summary (naming ``version``, with its figure), held-out results by robot,
    failures by stage, and training progress up to 100%."""
    retrains = [r for r in _flow_run(client, "retrain") if r.created >= started]
    completed = [r for r in retrains if r.state.is_completed()]
    assert len(completed) == 1, [(r.name, r.state.name) for r in retrains]
    run = completed[0]
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    keys = {a.key for a in artifacts}
    assert {"retrain-summary", "heldout-by-robot", "failures-by-stage"} <= keys
    summary = next(a for a in artifacts if a.key == "retrain-summary")
    assert f"version {version}" in summary.data and "data:image/png;base64," in summary.data
    assert re.search(r"\| seconds per step \| ingest [\d.]+, train [\d.]+, evaluate [\d.]+, promote [\d.]+ \|", summary.data)
    progress = client.read_artifacts(artifact_filter=ArtifactFilter(type={"any_": ["progress"]}))
    assert any(a.data == 100.0 for a in progress), "training reports progress up to 100%"


BOOTSTRAP_RUN = """
import os, sys
prefect_env = {k: v for k, v in os.environ.items() if k.startswith("PREFECT_")}
from tests.conftest import small_settings  # (it resets Prefect's env for in-process tests)
os.environ.update(prefect_env)  # same server, same result storage as the test
from components.config import TrainConfig
from flows.fleet_round import bootstrap
epochs = int(sys.argv[2])
settings = small_settings(__import__('pathlib').Path(sys.argv[1]), train=TrainConfig(method='filtered_bc', epochs=epochs, batch_size=64))
_, promotion = bootstrap(settings)
print('PROMOTED', promotion.decision.promote)
print('VERSION', promotion.candidate.version)
"""


READ_GRAIN = 5  # files per read task in the bootstrap tests: 12 demo files -> 3 read tasks


def _bootstrap_process(root: Path, api: str, epochs: int) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1",
           "FLEETLOOP_OPS__INGEST_FILES_PER_TASK": str(READ_GRAIN)}  # several read tasks per run
    return subprocess.Popen([sys.executable, "-c", BOOTSTRAP_RUN, str(root), str(epochs)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_killed_flow_reruns_from_cached_tasks_and_its_runs_are_read_back(tmp_path, prefect_server):
    """SIGKILL a bootstrap while it trains; the re-run (a new process, as a user would) completes,
    taking collection from the cache instead of recomputing it; file reads run again (their results
    are episodes, which Prefect must not persist: flows pass references). Its retrain run
    and artifacts are read back through the client (one bootstrap carries both checks)."""
    started = datetime.now(timezone.utc)
    proc = _bootstrap_process(tmp_path, prefect_server, epochs=4000)
    deadline = time.monotonic() + 240
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "train-policy" in line or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert any("train-policy" in line for line in seen), "".join(seen[-30:])

    rerun = _bootstrap_process(tmp_path, prefect_server, epochs=3)  # other training params: data steps stay cached
    out, _ = rerun.communicate(timeout=400)
    assert rerun.returncode == 0 and "PROMOTED True" in out, out[-3000:]
    version = int(re.search(r"^VERSION (\d+)$", out, flags=re.M).group(1))
    with get_client(sync_client=True) as client:
        _check_retrain_run_and_artifacts(client, started, version)

        def states(name: str) -> list[str]:
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))
            return sorted(r.state.name for r in runs if r.created >= started)  # this test's runs only

        collect, reads, trains = states("collect-expert"), states("read-episode"), states("train-policy")
    n_reads = math.ceil(2 * 6 / READ_GRAIN)  # small_settings: 2 expert robots x 6 episodes
    assert collect == ["Cached", "Completed"], collect
    assert reads == ["Completed"] * (2 * n_reads), reads  # never cached: a payload would be persisted
    assert "Completed" in trains  # the killed training ran again (its inputs changed), to completion


@pytest.mark.slow
def test_ingest_and_evaluation_fan_out_on_a_dask_cluster(tmp_path, prefect_server):
    """The same flows on a 2-process Dask LocalCluster (prefect-dask), configured by address only."""
    from distributed import LocalCluster

    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.workspace import Workspace
    from flows.evaluate import evaluate
    from flows.ingest import run_ingest
    from flows.runtime import task_runner
    from flows.train import train

    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1", dashboard_address=None) as cluster:
        settings = small_settings(tmp_path, ops=OpsConfig(dask_address=cluster.scheduler_address, eval_robots_per_task=1,
                                                           ingest_files_per_task=4, embed_episodes_per_task=4))
        demos = collect_expert_demos(settings, settings.paths.incoming / "expert")
        result = run_ingest(demos.files, settings)
        assert result.added == demos.episodes
        ws = Workspace(settings)
        assert ws.store.episode_ids() == set(ws.dataset.episode_ids())
        candidate = train(settings)
        report = evaluate.with_options(task_runner=task_runner(settings))(candidate.model_uri, "candidate", settings)
        outcome = load_candidate(candidate)
        assert report.overall.trials == settings.fleet.num_heldout_robots * settings.evaluation.trials_for(settings.fleet.num_heldout_robots)
        workers = cluster.scheduler_info["workers"]
        assert len(workers) == 2
    # the Dask run gives exactly what the in-process evaluation gives (seeded, per-robot streams)
    from components.pipeline.evaluate import evaluate_policy

    local = evaluate_policy(settings, outcome.result.policy, "candidate")
    assert local.overall.successes == report.overall.successes
    assert local.by_robot.keys() == report.by_robot.keys()


@pytest.mark.parametrize(
    ("ops", "engine", "address"),
    [
        ({}, "threads", None),
        ({"dask_address": "tcp://127.0.0.1:8786"}, "dask", "tcp://127.0.0.1:8786"),  # as before ops.engine
        ({"engine": "ray"}, "ray", "local"),  # never a stray cluster found on the machine
        ({"engine": "ray", "ray_address": "ray://head:10001"}, "ray", "ray://head:10001"),
        ({"ray_address": "10.0.0.5:6379"}, "ray", "10.0.0.5:6379"),
    ],
)
def test_one_setting_picks_the_fan_out_engine(tmp_path, ops, engine, address):
    """``ops.engine`` (or the one address that is set) picks the runner; nothing is started here."""
    from flows.runtime import task_runner

    runner = task_runner(small_settings(tmp_path, ops=OpsConfig(**ops)))
    assert type(runner).__name__ == {"threads": "ThreadPoolTaskRunner", "dask": "DaskTaskRunner", "ray": "RayTaskRunner"}[engine]
    assert getattr(runner, "address", None) == address


def test_ray_auto_joins_and_a_local_ray_cluster_is_sized_by_ops(tmp_path):
    from flows.runtime import task_runner

    auto = task_runner(small_settings(tmp_path, ops=OpsConfig(ray_address="auto")))
    assert auto.init_kwargs["address"] == "auto"  # ray.init(address="auto") fails when there is none to join
    local = task_runner(small_settings(tmp_path, ops=OpsConfig(engine="ray", max_workers=3, ray_object_store_mb=100)))
    ray_init = {k: v for k, v in local.init_kwargs.items() if k != "namespace"}  # prefect-ray adds its namespace
    assert ray_init == {"num_cpus": 3, "include_dashboard": False, "object_store_memory": 100 * 2**20}


@pytest.mark.parametrize(
    ("ops", "names"),
    [
        ({"engine": "threads", "dask_address": "tcp://h:8786"}, ("ops.dask_address", "ops.engine: dask")),
        ({"engine": "ray", "dask_address": "tcp://h:8786"}, ("ops.dask_address", "clear ops.dask_address")),
        ({"engine": "dask", "ray_address": "ray://h:10001"}, ("ops.ray_address", "ops.engine: ray")),
        ({"engine": "dask"}, ("ops.dask_address is empty", "tcp://HOST:8786")),
        ({"dask_address": "tcp://h:8786", "ray_address": "auto"}, ("both set",)),
        ({"engine": "ray", "ray_address": "tcp://h:6379"}, ("not a Ray address", "ray://HOST:10001")),
    ],
)
def test_an_engine_address_mismatch_names_the_field_and_the_fix(ops, names):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        OpsConfig(**ops)
    assert all(name in str(info.value) for name in names), str(info.value)


@pytest.fixture
def ray_stopped():
    """Ray is stopped after the test whatever happens: the flow's runner stops the local cluster it
    starts; this finalizer stops it if the run died first. Yields Ray's module."""
    import ray

    yield ray
    ray.shutdown()


def _ray_tasks(ray, expected: dict[str, int], patience_s: float = 60.0) -> dict[str, list[str]]:
    """Ray's own record of the tasks it ran (``ray.timeline()``): task name -> the worker of each run.

    Workers report task events about once a second, so it waits (up to ``patience_s``) until the
    expected counts are in; whatever is there then is returned and judged by the caller.
    """
    deadline = time.monotonic() + patience_s
    while True:
        seen: dict[str, list[str]] = {}
        for event in ray.timeline():
            if event["cat"].startswith("task::"):
                seen.setdefault(event["cat"].removeprefix("task::"), []).append(event["tid"])
        if all(len(seen.get(name, ())) >= n for name, n in expected.items()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


@pytest.mark.slow
def test_ingest_and_evaluation_fan_out_on_a_local_ray_cluster(tmp_path, prefect_server, ray_stopped):
    """The same flows on Ray (prefect-ray), chosen by ``ops.engine: ray`` alone: the outer flow's
    runner starts a local 2-CPU cluster (``ops.ray_address: ""``), the ingest and evaluate subflows run
    on it as ``retrain`` runs them, their tasks run in Ray worker processes and give what the
    in-process evaluation gives. The workers are this process's children: they inherit its
    PYTHONPATH and import fleetloop from the same tree (flows/runtime.py: ``_ray``)."""
    from prefect import flow

    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.evaluate import evaluate_policy, robot_groups
    from components.pipeline.workspace import Workspace
    from flows.evaluate import evaluate
    from flows.ingest import ingest
    from flows.runtime import task_runner
    from flows.train import train

    ray = ray_stopped
    settings = small_settings(tmp_path, ops=OpsConfig(engine="ray", max_workers=2, ray_object_store_mb=128, eval_robots_per_task=1,
                                                      ingest_files_per_task=4, embed_episodes_per_task=4))
    demos = collect_expert_demos(settings, settings.paths.incoming / "expert")
    tasks_expected = {"read-episodes": math.ceil(len(demos.files) / 4), "embed-episodes": math.ceil(demos.episodes / 4),
                      "heldout-rollouts": len(robot_groups(settings))}

    @flow(name="ingest-train-evaluate")
    def ingest_train_evaluate():
        fan_out = {"task_runner": task_runner(settings)}  # a subflow reuses the Ray its parent started
        ingested = ingest.with_options(**fan_out)(demos.files, settings)
        candidate = train(settings)
        report = evaluate.with_options(**fan_out)(candidate.model_uri, "candidate", settings)
        driver = f"worker:{ray.get_runtime_context().get_worker_id()}"
        return ingested, candidate, report, _ray_tasks(ray, tasks_expected), driver

    result, candidate, report, tasks, driver = ingest_train_evaluate.with_options(task_runner=task_runner(settings))()
    policy = load_candidate(candidate).result.policy
    assert not ray.is_initialized()  # the runner stopped the cluster it started
    assert result.added == demos.episodes
    ws = Workspace(settings)
    assert ws.store.episode_ids() == set(ws.dataset.episode_ids())
    assert report.overall.trials == settings.fleet.num_heldout_robots * settings.evaluation.trials_for(settings.fleet.num_heldout_robots)
    # every mapped task ran once, as a Ray task, in a Ray worker process (not the driver)
    assert {name: len(tasks.get(name, ())) for name in tasks_expected} == tasks_expected, tasks
    workers = {tid for name in tasks_expected for tid in tasks[name]}
    assert all(tid.startswith("worker:") for tid in workers) and driver not in workers, (workers, driver)
    # the Ray run gives exactly what the in-process evaluation gives (seeded, per-robot streams)
    local = evaluate_policy(settings, policy, "candidate")
    assert local.overall.successes == report.overall.successes
    assert {r: p.successes for r, p in local.by_robot.items()} == {r: p.successes for r, p in report.by_robot.items()}


def test_schedules_come_from_params(tmp_path):
    from flows.schedules import FLEET_ROUND_DEPLOYMENT, RETRAIN_DEPLOYMENT, deployments

    settings = small_settings(tmp_path, ops=OpsConfig(retrain_cron="15 2 * * *", fleet_round_interval_s=3600))
    by_name = {d.name: d for d in deployments(settings)}
    assert set(by_name) == {RETRAIN_DEPLOYMENT, FLEET_ROUND_DEPLOYMENT}
    assert by_name[RETRAIN_DEPLOYMENT].schedules[0].schedule.cron == "15 2 * * *"
    assert by_name[FLEET_ROUND_DEPLOYMENT].schedules[0].schedule.interval.total_seconds() == 3600


@pytest.mark.slow
def test_prefect_yaml_deploys_both_schedules_to_a_process_pool(prefect_server):
    """`make deploy`'s two commands against a real server: the deployments land with their schedules."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "FLEETLOOP_REPO": str(REPO)}
    for cmd in (
        [str(bin_dir / "prefect"), "work-pool", "create", "fleetloop-process", "--type", "process"],
        [str(bin_dir / "prefect"), "--no-prompt", "deploy", "--all"],
    ):
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["nightly-retrain", "fleet-round"])))
        schedules = {d.name: d.schedules[0].schedule for d in found}
        assert schedules["nightly-retrain"].cron == "0 3 * * *"
        assert schedules["fleet-round"].interval.total_seconds() == 21600
        assert all(d.work_pool_name == "fleetloop-process" for d in found)
