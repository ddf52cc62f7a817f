"""`fleetloop reproduce VERSION`: a registered model rebuilt from its lineage alone -- the DVC snapshot
out of the cache, the segment store at its kept version, the champion it fine-tuned -- gives the
registered weights bit for bit, after the data has moved on; a version it cannot rebuild is refused
in one line, and a model whose weights are not what its lineage builds is reported, exit 1."""

from __future__ import annotations

import dataclasses
import json

import yaml

from cli.main import main
from components.config import FertConfig, StoreConfig, TrainConfig
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos, collect_fleet
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import ingest_files
from components.pipeline.promote import register_candidate
from components.pipeline.recipe import SETTINGS_ARTIFACT, public_settings
from components.pipeline.workspace import Workspace
from components.registry.lineage import Lineage
from tests.conftest import small_settings


def test_reproduce_rebuilds_each_version_from_its_lineage(tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    settings = small_settings(root, train=TrainConfig(method="fert", epochs=2, batch_size=64, steps_per_iteration=10,
                                                      validation_robots=1), fert=FertConfig(calibration_episodes=20),
                              store=StoreConfig(model_versions_kept=2))
    (root / "params.yaml").parent.mkdir(parents=True)
    (root / "params.yaml").write_text(yaml.safe_dump(public_settings(settings)))
    monkeypatch.setenv("FLEETLOOP_ROOT", str(root))
    registry = Workspace(settings).registry

    # v1: the bootstrap on expert demos (a DVC snapshot per ingest)
    ingest_files(settings, collect_expert_demos(settings, root / "demos").files)
    first = steps.train_policy(settings)
    report = evaluate_policy(settings, first.result.policy, "bootstrap")  # not this test's subject: one for all

    def register(outcome, name: str) -> int:
        return register_candidate(settings, outcome, report, name).version

    v1 = register(first, "bootstrap")
    registry.set_champion(v1)
    assert first.lineage.recipe == "train-task" and first.lineage.champion_version == -1
    # v2: v1's fleet round (its failures query the store), fine-tuned from v1; the data moves on
    ingest_files(settings, collect_fleet(settings, first.result.policy, f"v{v1}", root / "round", 1).files)
    second = steps.train_policy(settings)
    assert second.lineage.champion_version == v1 and second.summary.retrieved_segments > 0
    assert second.lineage.snapshot_hash != first.lineage.snapshot_hash
    v2 = register(second, "round-1")
    store = Workspace(settings).store
    assert store.tags()["model-v1"] == first.lineage.lancedb_version  # kept for the rebuild: upkeep never prunes it
    assert store.tags()["model-v2"] == second.lineage.lancedb_version
    logged = registry.run_dict(registry.get_version(v2).run_id, SETTINGS_ARTIFACT)
    assert logged["train"]["method"] == "fert" and "root" not in logged

    assert main(["reproduce", "champion", "--json"]) == 0  # v1, by its alias
    rebuilt = json.loads(capsys.readouterr().out)
    assert rebuilt["matches"] and rebuilt["champion"] is None and rebuilt["same_commit"]
    assert rebuilt["episodes"] == first.lineage.episodes < Workspace(settings).dataset.num_episodes  # the old snapshot
    assert rebuilt["store_version"] == first.lineage.lancedb_version

    assert main(["reproduce", str(v2), "--scratch", str(tmp_path / "scratch-v2")]) == 0
    out = capsys.readouterr().out
    assert f"v{v2} reproduced: same weights" in out
    assert (tmp_path / "scratch-v2" / "datasets").exists()  # --scratch is kept

    # weights that are not what their lineage builds: reported, exit 1
    swapped = dataclasses.replace(first, result=dataclasses.replace(first.result, policy=second.result.policy))
    v3 = register(swapped, "swapped")
    assert main(["reproduce", str(v3)]) == 1
    assert f"v{v3} NOT reproduced" in capsys.readouterr().out
    # only the newest store.model_versions_kept models pin their store version (a tag stops pruning)
    assert sorted(n for n in Workspace(settings).store.tags() if n.startswith("model-v")) == ["model-v2", "model-v3"]
    assert main(["reproduce", str(v1)]) == 1
    assert "is no longer kept" in capsys.readouterr().err

    # a version the train task did not build (the fleet's trainer, torchrun): one line naming why
    lineage = Lineage(git_commit="abc", snapshot_hash="d41d8.dir", lancedb_version=3, params_hash="p", episodes=10, frames=100)
    v4 = registry.log_candidate(first.result.policy, {"success_rate": 0.5, "ci_low": 0.1, "ci_high": 0.9, "successes": 1,
                                                      "trials": 2}, lineage, {}, {}, [1.0], "fleet").version
    assert main(["reproduce", str(v4)]) == 1
    err = capsys.readouterr().err
    assert "not built by the train task" in err and "fix:" in err and "Traceback" not in err
