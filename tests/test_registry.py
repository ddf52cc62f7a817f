"""The MLflow registry on a real SQLite store: versions, aliases, gate, rollback, loading."""

import torch

from components.config import PolicyConfig, RegistryConfig
from components.policy.factory import make_policy
from components.registry.lineage import Lineage
from components.registry.model_registry import PolicyRegistry, RegistryError

import pytest


def _policy(seed: int):
    torch.manual_seed(seed)
    return make_policy(6, 3, PolicyConfig(hidden=16, layers=2))


def _eval(successes: int, trials: int = 120) -> dict:
    return {"success_rate": successes / trials, "ci_low": 0.0, "ci_high": 1.0, "successes": successes, "trials": trials}


LINEAGE = Lineage(git_commit="abc", snapshot_hash="d41d8.dir", lancedb_version=3, params_hash="p", episodes=10, frames=100)


def _log(registry: PolicyRegistry, seed: int, successes: int):
    return registry.log_candidate(_policy(seed), _eval(successes), LINEAGE, {"train": {"lr": 0.001}}, {"loss": 0.1}, [1.0, 0.5], f"run-{seed}")


def test_register_promote_rollback(tmp_path):
    registry = PolicyRegistry(tmp_path / "mlruns", RegistryConfig())
    first = _log(registry, 0, 90)
    assert registry.promote_if_better(first, None, None).promote
    assert registry.champion().version == first.version
    assert first.lineage == LINEAGE  # lineage travels with every version

    equal = _log(registry, 1, 90)
    decision = registry.promote_if_better(equal, 90, 120)
    assert not decision.promote
    assert registry.champion().version == first.version

    better = _log(registry, 2, 118)
    assert registry.promote_if_better(better, 90, 120).promote
    assert registry.aliases() == {"champion": better.version, "previous": first.version}

    restored = registry.rollback()
    assert restored.version == first.version
    assert registry.aliases() == {"champion": first.version}
    with pytest.raises(RegistryError, match="nothing to roll back"):
        registry.rollback()


def test_loaded_champion_is_trainable_and_equal(tmp_path):
    registry = PolicyRegistry(tmp_path / "mlruns", RegistryConfig())
    policy = _policy(3)
    version = registry.log_candidate(policy, _eval(60), LINEAGE, {}, {}, [], "run")
    registry.promote_if_better(version, None, None)
    loaded = registry.load("champion")
    x = torch.randn(5, 6)
    assert torch.equal(loaded(x), policy(x))
    loaded.train()  # a pickled model can be fine-tuned (a pt2 export could not)
    assert any(p.requires_grad for p in loaded.parameters())


def test_canary_rollout_leaves_champion_until_live_outcomes(tmp_path):
    """rollout: canary — a model that passes the offline gate first becomes `canary`, not `champion`."""
    from components.config import RegistryConfig as RC
    from components.evaluation.heldout import EvaluationReport
    from components.evaluation.intervals import wilson_interval
    from components.pipeline.promote import gate_candidate
    from components.pipeline.workspace import Workspace
    from tests.conftest import small_settings

    settings = small_settings(tmp_path, registry=RC(rollout="canary"))
    registry = Workspace(settings).registry
    first = _log(registry, 0, 90)
    assert gate_candidate(settings, first, None).champion_after == first.version  # no champion yet: direct

    challenger = _log(registry, 1, 118)
    champion_eval = EvaluationReport(wilson_interval(90, 120), {}, {}, f"v{first.version}", 120)
    outcome = gate_candidate(settings, challenger, champion_eval)
    assert outcome.decision.promote
    assert outcome.champion_after == first.version  # the champion still serves most of the fleet
    assert outcome.canary == challenger.version
    assert registry.aliases()["canary"] == challenger.version


def test_a_new_root_is_seeded_from_the_migrated_template_and_an_existing_store_is_never_touched(tmp_path, monkeypatch):
    import sqlite3

    from components.registry.local_store import seed_local_db

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry = PolicyRegistry(tmp_path / "a" / "mlruns", RegistryConfig())  # the template is built on first use
    assert list((tmp_path / "cache" / "fleetloop").glob("mlflow-*-empty.db"))
    db = tmp_path / "a" / "mlruns" / "mlflow.db"
    default = sqlite3.connect(db).execute("SELECT artifact_location FROM experiments WHERE experiment_id = 0").fetchone()
    assert default == ((tmp_path / "a" / "mlruns" / "artifacts").resolve().as_uri() + "/0",)  # this root's, not the cwd's
    first = _log(registry, 0, 90)  # a seeded store is a working MLflow store: register, alias, load
    assert registry.promote_if_better(first, None, None).promote
    assert registry.champion().version == first.version and registry.load("champion").obs_dim == 6

    before = db.read_bytes()
    assert not seed_local_db(db, "file:///elsewhere") and db.read_bytes() == before  # never over a store

    (tmp_path / "not-a-folder").write_text("")  # no usable cache: MLflow creates the store itself
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    assert not seed_local_db(tmp_path / "b" / "mlflow.db", "file:///b")
    assert not (tmp_path / "b" / "mlflow.db").exists()
    fallback = PolicyRegistry(tmp_path / "c" / "mlruns", RegistryConfig())
    assert fallback.promote_if_better(_log(fallback, 1, 90), None, None).promote
