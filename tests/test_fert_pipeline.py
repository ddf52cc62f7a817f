"""The train step with FERT on a real dataset, LanceDB store and MLflow registry: fine-tunes the champion."""

from __future__ import annotations

import torch

from components.config import FertConfig, TrainConfig
from components.pipeline import steps
from components.pipeline.collect import collect_expert_demos, collect_fleet
from components.pipeline.evaluate import evaluate_policy
from components.pipeline.ingest import ingest_files
from components.pipeline.promote import gate_candidate, register_candidate
from components.pipeline.workspace import Workspace
from tests.conftest import small_settings


def test_fert_trains_from_the_champion_on_its_failures(tmp_path):
    settings = small_settings(
        tmp_path, train=TrainConfig(method="fert", epochs=2, batch_size=64), fert=FertConfig(calibration_episodes=20)
    )
    demos = collect_expert_demos(settings, tmp_path / "incoming")
    ingest_files(settings, demos.files, snapshot=False)

    # bootstrap: no champion and no failures yet -> trained from scratch on the successes
    first = steps.train_policy(settings)
    assert first.frames == sum(ep.length for ep in Workspace(settings).dataset.episodes())
    report = evaluate_policy(settings, first.result.policy, "candidate")
    gate_candidate(settings, register_candidate(settings, first, report, "bootstrap"), None)
    champion = Workspace(settings).registry.champion()
    assert champion is not None

    # the champion runs on the fleet; its failures query the store
    champion_policy = Workspace(settings).registry.load("champion")
    fleet = collect_fleet(settings, champion_policy, f"v{champion.version}", tmp_path / "round1", round_index=1)
    ingest_files(settings, fleet.files, snapshot=False)
    ws = Workspace(settings)
    built = steps.training_set(settings, ws)
    data = built.data
    assert built.report.method == "fert" and built.report.failed_episodes > 0 and built.report.matches > 0
    episodes = list(ws.dataset.episodes())
    successes = sum(ep.length for ep in episodes if ep.success)
    assert len(data.states) == successes  # failed frames are never in the set
    assert data.weights is not None and abs(float(data.weights.sum()) - 1.0) < 1e-9

    second = steps.train_policy(settings)
    assert second.summary is not None and second.summary.retrieved_segments == built.report.matches
    # fine-tuned from the champion: its normalizers are kept, not refitted on the new data
    assert torch.equal(second.result.policy.obs_norm.mean, champion_policy.obs_norm.mean)
    assert not torch.equal(second.result.policy.core.state_dict()[next(iter(second.result.policy.core.state_dict()))],
                           champion_policy.core.state_dict()[next(iter(champion_policy.core.state_dict()))])
    assert second.lineage.lancedb_version == ws.store.version


def test_ingest_fits_the_learned_window_encoder_when_configured(tmp_path):
    from components.fert.encoder import ActionPredictiveEncoder

    settings = small_settings(tmp_path, fert=FertConfig(encoder="learned", learned_dim=8, learned_epochs=2))
    demos = collect_expert_demos(settings, tmp_path / "incoming")
    ingest_files(settings, demos.files, snapshot=False)
    store = Workspace(settings).store
    encoder = store.load_encoder()
    assert isinstance(encoder, ActionPredictiveEncoder) and encoder.dim == 8
    assert store.count() > 0
    # the stored encoder is the one later ingests reuse: a second ingest embeds with the same vectors
    ep = next(iter(Workspace(settings).dataset.episodes()))
    window = store.segment_rows([ep], encoder, "check").column("vector")[0].as_py()
    again = store.segment_rows([ep], store.load_encoder(), "check").column("vector")[0].as_py()
    assert window == again and len(window) == 8
