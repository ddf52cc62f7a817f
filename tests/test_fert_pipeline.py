"""The train step with FERT on a real dataset, LanceDB store and MLflow registry: fine-tunes the champion."""

from __future__ import annotations

import numpy as np
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


def test_the_train_task_reads_the_dataset_as_a_corpus_and_builds_what_episodes_in_memory_build(tmp_path):
    """The train task's corpus reads the successes' frames and only the failures that query, and
    builds the same training set, bit for bit, as the same episodes handed over in memory (the
    fleet trainer's and ``fleetloop reproduce``'s path)."""
    from components.fert.corpus import DatasetCorpus

    settings = small_settings(tmp_path, train=TrainConfig(method="fert"), fert=FertConfig(calibration_episodes=20))
    ingest_files(settings, collect_expert_demos(settings, tmp_path / "incoming").files, snapshot=False)
    policy = steps.train_policy(settings).result.policy
    fleet = collect_fleet(settings, policy, "v7", tmp_path / "round1", round_index=1)
    ingest_files(settings, fleet.files, snapshot=False)
    ws = Workspace(settings)
    episodes = list(ws.dataset.episodes())
    assert any(not ep.success for ep in episodes)

    corpus = DatasetCorpus(ws.dataset)
    loaded: list[str] = []
    load = corpus.load
    corpus.load = lambda ids: loaded.extend(ids) or load(ids)  # records what is decoded whole
    for method in ("bc", "filtered_bc", "fert"):
        cfg = settings.model_copy(update={"train": settings.train.model_copy(update={"method": method})})
        streamed = steps.method_training_set(cfg, corpus, ws.store, 7)
        in_memory = steps.method_training_set(cfg, episodes, ws.store, 7)
        for name in ("states", "actions", "weights", "frame_in_episode"):
            a, b = getattr(streamed.data, name), getattr(in_memory.data, name)
            assert (a is None and b is None) or np.array_equal(a, b), (method, name)
        assert {k: v for k, v in streamed.report.to_dict().items() if k != "seconds"} == \
               {k: v for k, v in in_memory.report.to_dict().items() if k != "seconds"}
    failed = {ep.episode_id for ep in episodes if not ep.success}
    successes = {ep.episode_id for ep in episodes if ep.success}
    assert failed <= set(loaded)  # the failures query (v7 has none of its own: every failure)
    assert len(set(loaded) & successes) <= settings.fert.calibration_episodes  # held out to calibrate only


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
