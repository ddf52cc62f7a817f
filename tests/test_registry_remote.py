"""The registry on a team's stores, by configuration alone: an MLflow tracking server on Postgres
with artifacts on S3 (real servers on loopback, tests/servers.py), and what people see when a
store is down or a URI carries a password."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from cli.main import main
from components.config import RegistryConfig, load_settings
from components.pipeline.recipe import SETTINGS_ARTIFACT
from components.registry.model_registry import PolicyRegistry
from components.registry.tracking import TrackingStoreError, redact_uri, split_credentials
from tests.conftest import small_settings
from tests.servers import ARTIFACT_BUCKET, ARTIFACT_PREFIX, free_port, registry_env

PASSWORD = "s3cret-never-shown"
ROBOT = "robot-0000"
REQUEST_TIMEOUT_S = 30.0
SWAP_TIMEOUT_S = 60.0
POLL_S = 0.1


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _point_at_remote_stores(monkeypatch, root, mlflow_server, s3_server) -> str:
    """Only env, as a team would set it; returns the tracking URI (with a password to be redacted:
    MLflow sends it as basic auth, which the test server ignores and a server behind auth checks)."""
    tracking = mlflow_server.url.replace("http://", f"http://fleetloop:{PASSWORD}@")
    env = {**registry_env(mlflow_server, s3_server), "FLEETLOOP_REGISTRY__TRACKING_URI": tracking,
           # every challenger passes (alpha 1): the test owns the alias history; test_gate tests the statistics
           "FLEETLOOP_REGISTRY__GATE_ALPHA": "1.0", "FLEETLOOP_ROOT": str(root)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # set from the URI by the registry:
        monkeypatch.setenv(key, "")  # recorded here so that they are gone again after the test
    return tracking


@pytest.mark.slow
def test_registry_on_a_tracking_server_with_postgres_and_s3(tmp_path, monkeypatch, capsys, mlflow_server, s3_server,
                                                            postgres_server):
    """Train -> register -> gate -> @champion -> load -> a fine-tuned second round -> rollback, all
    through the server: versions in Postgres, models in S3, nothing under <root>/mlruns."""
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.evaluate import evaluate_policy
    from components.pipeline.ingest import ingest_files
    from components.pipeline.promote import gate_candidate, register_candidate

    tracking = _point_at_remote_stores(monkeypatch, tmp_path, mlflow_server, s3_server)
    settings = small_settings(tmp_path)
    assert settings.registry.tracking_uri == tracking  # from env alone
    ingest_files(settings, collect_expert_demos(settings, settings.paths.incoming / "expert").files, snapshot=False)

    first = steps.train_policy(settings)
    first_eval = evaluate_policy(settings, first.result.policy, "candidate")
    v1 = register_candidate(settings, first, first_eval, "remote-bootstrap")
    assert gate_candidate(settings, v1, None).champion_after == v1.version
    second = steps.train_policy(settings)  # fine-tunes @champion, loaded back from S3 through the server
    assert not _same_weights(second.result.policy, first.result.policy)
    v2 = register_candidate(settings, second, evaluate_policy(settings, second.result.policy, "candidate"), "remote-round")
    assert gate_candidate(settings, v2, first_eval).champion_after == v2.version

    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)  # a fresh client: state lives in the stores
    assert registry.aliases() == {"champion": v2.version, "previous": v1.version}
    assert registry.get_version(v2.version).lineage == second.lineage
    assert _same_weights(registry.load("champion"), second.result.policy)
    assert registry.rollback().version == v1.version
    assert registry.aliases() == {"champion": v1.version}
    assert _same_weights(registry.load("champion"), first.result.policy)

    rows = postgres_server.query("mlflow", "SELECT version FROM model_versions WHERE name = 'fleetloop-policy' ORDER BY version")
    assert rows == [[str(v1.version)], [str(v2.version)]]  # the registry is the server's Postgres
    stored = s3_server.keys(ARTIFACT_BUCKET, ARTIFACT_PREFIX)  # runs' files and models, under registry.artifact_uri
    for version in (v1, v2):
        run_files = {key.split(f"/{version.run_id}/artifacts/", 1)[1] for key in stored if f"/{version.run_id}/artifacts/" in key}
        assert {"state_dict.pt", "evaluation.json", "training.json"} <= run_files
    assert len([key for key in stored if "/models/" in key and key.endswith("/data/model.pth")]) == 2  # MLflow 3 logged models
    assert not (tmp_path / "mlruns").exists()

    _inference_serves_the_champion_and_hot_swaps(settings, registry, v1.version, v2.version)

    during = capsys.readouterr()
    assert PASSWORD not in during.out + during.err  # MLflow's own prints (run links) never carry it
    run = registry.client.get_run(v2.run_id)  # nor what the runs keep: params (shown in the UI), settings
    assert run.data.params["registry.tracking_uri"] == redact_uri(tracking)
    assert PASSWORD not in json.dumps(run.data.params) + json.dumps(registry.run_dict(v2.run_id, SETTINGS_ARTIFACT))
    assert main(["status", "--json"]) == 0
    out = capsys.readouterr().out
    status = json.loads(out)
    assert status["champion"]["version"] == v2.version  # moved back by the hot-swap check
    assert status["registry"] == {"tracking_uri": redact_uri(tracking),
                                  "artifact_uri": f"s3://{ARTIFACT_BUCKET}/{ARTIFACT_PREFIX}"}
    assert main(["status"]) == 0
    assert PASSWORD not in out + capsys.readouterr().out
    assert not (tmp_path / "mlruns").exists()


def _inference_serves_the_champion_and_hot_swaps(settings, registry: PolicyRegistry, champion: int, challenger: int) -> None:
    """The fleet's inference service (its own process: the registry settings in its settings file,
    the S3 keys in its inherited env) serves @champion from the server and follows the alias."""
    from components.fleet.auth import issue_tokens
    from components.fleet.clients import InferenceClient
    from components.fleet.layout import RuntimeLayout
    from components.fleet.local import running_service, service_url, with_free_ports
    from components.pipeline.workspace import Workspace

    fleet = with_free_ports(settings, alias_poll_s=0.2)
    tokens = issue_tokens(RuntimeLayout.of(fleet).ensure().token_file, [ROBOT])
    obs = np.random.default_rng(0).normal(size=Workspace(settings).obs_dim).astype(np.float32)
    with running_service(fleet, "inference"):
        client = InferenceClient(service_url(fleet, "inference"), tokens.robots[ROBOT], REQUEST_TIMEOUT_S)
        served = client.act(obs)
        assert served.version == champion
        np.testing.assert_allclose(served.action, _action(registry, champion, obs), rtol=1e-5, atol=1e-6)
        registry.set_champion(challenger)
        deadline = time.monotonic() + SWAP_TIMEOUT_S
        while (served := client.act(obs)).version != challenger and time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert served.version == challenger, "the service never followed @champion"
        np.testing.assert_allclose(served.action, _action(registry, challenger, obs), rtol=1e-5, atol=1e-6)


def _action(registry: PolicyRegistry, version: int, obs: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return registry.load(version).eval()(torch.as_tensor(obs[None])).numpy()[0]


def test_tracking_server_down_at_start_is_one_line_naming_the_store_and_the_fix(tmp_path, monkeypatch, capsys):
    port = free_port()  # nothing listens there
    uri = f"http://fleetloop:{PASSWORD}@127.0.0.1:{port}"
    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    monkeypatch.setenv("FLEETLOOP_REGISTRY__TRACKING_URI", uri)

    assert main(["status"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"error: MLflow tracking store http://fleetloop:***@127.0.0.1:{port} is not reachable")
    assert lines[1].startswith("fix: start the tracking server")
    assert PASSWORD not in "\n".join(lines)
    with pytest.raises(TrackingStoreError, match="is not reachable") as raised:
        PolicyRegistry(tmp_path / "mlruns", RegistryConfig(tracking_uri=uri))
    assert PASSWORD not in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "mlruns").exists()


def test_artifact_uri_places_new_experiments_and_a_moved_root_is_refused(tmp_path):
    """On the embedded store too: a new experiment keeps artifacts at registry.artifact_uri; an
    existing one is never silently left elsewhere."""
    elsewhere = (tmp_path / "shared-artifacts").as_uri()
    registry = PolicyRegistry(tmp_path / "mlruns", RegistryConfig(artifact_uri=elsewhere))
    assert registry.client.get_experiment(registry.experiment_id).artifact_location == elsewhere
    with pytest.raises(TrackingStoreError, match="keeps its artifacts at") as raised:
        PolicyRegistry(tmp_path / "mlruns", RegistryConfig(artifact_uri=(tmp_path / "other").as_uri()))
    assert raised.value.fix.startswith("use a new registry.experiment")


def test_params_yaml_with_a_password_in_a_store_uri_is_refused(tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text(f"registry:\n  tracking_uri: postgresql://mlflow:{PASSWORD}@db:5432/mlflow\n")
    monkeypatch.setenv("FLEETLOOP_ROOT", str(tmp_path))
    with pytest.raises(ValueError, match="registry.tracking_uri holds a password") as raised:
        load_settings()
    assert PASSWORD not in str(raised.value)


def test_http_credentials_leave_the_uri_for_mlflows_env():
    assert split_credentials(f"https://ci:{PASSWORD}@mlflow.example.com/") == (
        "https://mlflow.example.com/", {"MLFLOW_TRACKING_USERNAME": "ci", "MLFLOW_TRACKING_PASSWORD": PASSWORD})
    database = f"postgresql://mlflow:{PASSWORD}@db:5432/mlflow"
    assert split_credentials(database) == (database, {})  # a database driver takes them from the URI (or ~/.pgpass)


@pytest.mark.parametrize(("uri", "shown"), [
    (f"postgresql://mlflow:{PASSWORD}@db.internal:5432/mlflow", "postgresql://mlflow:***@db.internal:5432/mlflow"),
    (f"https://ci:{PASSWORD}@mlflow.example.com/", "https://ci:***@mlflow.example.com/"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
])
def test_redact_uri(uri, shown):
    assert redact_uri(uri) == shown


def test_the_fleet_settings_file_never_holds_a_store_password(tmp_path, monkeypatch):
    """Fleet children read <root>/fleet-runtime/state/settings.json; a tracking URI with a password
    stays out of it, and the children get it from the environment they inherit."""
    from components.fleet.processes import read_settings, write_settings

    uri = "postgresql://fleet:s3cret-pw@127.0.0.1:5432/mlflow"
    monkeypatch.setenv("FLEETLOOP_REGISTRY__TRACKING_URI", uri)
    path = write_settings(small_settings(tmp_path))
    assert "s3cret-pw" not in path.read_text()
    assert read_settings(path).registry.tracking_uri == uri
