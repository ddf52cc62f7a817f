"""FERT on camera windows (``fert.encoder: camera``): camera episodes (expert demos + noisy-policy
failures) stored with their video streams in a scratch root, embedded through the real ingest
functions; the store's vectors come from the frames, retrieval answers a failure with successes,
the fert training set builds on them, and the failure explorer shows the frames side by side."""

from __future__ import annotations

import dataclasses
import json

import matplotlib.image
import numpy as np
import pytest

from components.config import FertConfig, SimConfig
from components.episodes.record import camera_key
from components.fert.camera_encoder import CameraWindowEncoder, downsample
from components.fert.corpus import EpisodeList
from components.fert.explorer import THUMB_BAR, THUMB_FRAMES, THUMB_GAP, explain
from components.fert.methods import build_training_set
from components.fert.retrieval_record import RetrievalRecord
from components.pipeline.ingest import embed_pending, episodes_to_embed, store_encoder
from components.pipeline.workspace import Workspace
from components.sim.collect import run_episodes
from components.sim.factory import make_expert, make_exploration, stages, workspace_view
from components.store.encoder import encode_episodes, encoder_fingerprint
from components.store.windows import cut_windows
from tests.conftest import small_settings

SIZE = 32  # rendered frames (the default is 64: smaller keeps the video round trip fast)
SIM = SimConfig(cameras=("scene", "gripper"), motion_noise_std=1.5)
SIM = SIM.model_copy(update={"camera": SIM.camera.model_copy(update={"width": SIZE, "height": SIZE})})
KEYS = (camera_key("gripper"), camera_key("scene"))
FERT = FertConfig(encoder="camera", camera_size=16, learned_epochs=5, calibration_episodes=8, failures_from="all")


def _episodes() -> list:
    robots = [f"robot-{i:04d}" for i in range(3)]
    demos = run_episodes(make_expert(SIM), robots, SIM, 4, seed=0, policy_version="expert")
    noisy = run_episodes(make_exploration(SIM, make_expert(SIM), seed=1), robots, SIM, 4, seed=1, policy_version="v1")
    return demos + noisy


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A root whose dataset stores camera episodes and whose store holds their camera windows."""
    path = tmp_path_factory.mktemp("cameras")
    settings = small_settings(path, sim=SIM, fert=FERT)
    episodes = _episodes()
    assert any(not ep.success for ep in episodes) and sum(ep.success for ep in episodes) >= 8
    ws = Workspace(settings)
    ws.dataset.add_episodes(episodes)
    segments = embed_pending(settings)
    stored = Workspace(settings).dataset.load_episodes(list(range(len(episodes))), cameras=True)
    return settings, stored, segments


def test_the_store_embeds_camera_windows_with_the_camera_encoder(root) -> None:
    settings, stored, segments = root
    store = Workspace(settings).store
    encoder = store.load_encoder()
    assert isinstance(encoder, CameraWindowEncoder) and encoder.cameras == KEYS
    windows = sum(len(cut_windows(ep.states, settings.store.window, settings.store.stride)) for ep in stored)
    assert segments == windows == store.count()
    assert episodes_to_embed(settings) == []  # everything embedded; the cursor moved
    # the stored vectors are the encoder on the decoded frames (the store read the video back)
    ep = stored[0]
    row = store.segment_rows([ep], encoder, "check").column("vector").to_pylist()
    cut = cut_windows(ep.states, settings.store.window, settings.store.stride)
    assert np.array_equal(np.asarray(row, np.float32), encode_episodes(encoder, [ep], [cut]))


def test_vectors_follow_the_frames_not_the_states(root) -> None:
    settings, stored, _ = root
    encoder = Workspace(settings).store.load_encoder()
    w, s = settings.store.window, settings.store.stride
    a, b = stored[0], stored[1]
    # same states, other frames: other vectors; same frames, other states: the same vectors
    swapped = dataclasses.replace(a, episode_id="swapped", cameras={k: _fit_length(b.cameras[k], a.length) for k in KEYS})
    cut = cut_windows(a.states, w, s)
    mine, theirs = encode_episodes(encoder, [a], [cut]), encode_episodes(encoder, [swapped], [cut])
    assert np.abs(mine - theirs).max() > 1e-3
    moved = dataclasses.replace(a, states=a.states + 1.0)
    assert np.array_equal(encode_episodes(encoder, [moved], [cut_windows(moved.states, w, s)]), mine)
    # a window's code depends on the frames it looks at only: the frames between are not read
    blurred = {k: a.cameras[k].copy() for k in KEYS}
    looked = set((cut.starts[:, None] + encoder.positions).ravel().tolist())
    for k in KEYS:
        for t in range(a.length):
            if t not in looked:
                blurred[k][t] = 0
    assert np.array_equal(encode_episodes(encoder, [dataclasses.replace(a, cameras=blurred)], [cut]), mine)


def _fit_length(frames: np.ndarray, length: int) -> np.ndarray:
    index = np.minimum(np.arange(length), len(frames) - 1)
    return frames[index]


def test_the_camera_encoder_is_seeded_and_round_trips_through_json(root) -> None:
    settings, stored, _ = root
    store = Workspace(settings).store
    again = store_encoder(settings.model_copy(update={}), Workspace(settings))  # the stored one: no refit
    assert encoder_fingerprint(again) == store.encoder_fingerprint()
    w, s = settings.store.window, settings.store.stride

    def fit(seed: int) -> CameraWindowEncoder:
        return CameraWindowEncoder.from_successes(stored, w, s, KEYS, 8, 2, seed, size=16)

    first, second, other = fit(0), fit(0), fit(1)
    assert encoder_fingerprint(first) == encoder_fingerprint(second) != encoder_fingerprint(other)
    rebuilt = CameraWindowEncoder.from_state_dict(json.loads(json.dumps(first.state_dict())))
    cut = [cut_windows(ep.states, w, s) for ep in stored[:3]]
    assert np.array_equal(encode_episodes(rebuilt, stored[:3], cut), encode_episodes(first, stored[:3], cut))
    assert len(json.dumps(store.load_encoder().state_dict())) < 1 << 20  # kept in the store's metadata


def test_downsampling_is_a_block_mean_and_keeps_a_frame_of_the_size() -> None:
    frames = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    small = downsample(frames, 2)
    assert small.shape == (2, 2, 2, 3) and small[0, 0, 0, 0] == np.rint(frames[0, :2, :2, 0].mean())
    assert np.array_equal(downsample(small, 2), small)


def test_retrieval_answers_failures_with_successes_and_the_fert_set_builds(root) -> None:
    settings, stored, _ = root
    store = Workspace(settings).store
    built = build_training_set("fert", EpisodeList(stored), settings.fert, store, store.load_encoder(), seed=0)
    report, retrieved = built.report, built.retrieved
    by_id = {ep.episode_id: ep for ep in stored}
    assert report.failed_episodes == sum(not ep.success for ep in stored) > 0
    assert report.queries > 0 and report.matches > 0 and len(retrieved) == report.matches
    assert all(by_id[e].success for e in retrieved.episode_ids)
    assert set(retrieved.query_episode_ids) <= {ep.episode_id for ep in stored if not ep.success}
    assert built.data.weights is not None and np.isclose(built.data.weights.sum(), 1.0)
    assert report.retrieved_frames > 0


def test_a_camera_encoder_on_a_dataset_without_cameras_names_the_setting(tmp_path) -> None:
    plain = SimConfig()
    settings = small_settings(tmp_path, sim=plain, fert=FERT)
    Workspace(settings).dataset.add_episodes(
        run_episodes(make_expert(plain), ["robot-0000"], plain, 2, seed=0, policy_version="expert"))
    with pytest.raises(RuntimeError, match=r"fert.encoder=camera .* no camera streams.*sim.cameras"):
        store_encoder(settings)
    with pytest.raises(RuntimeError, match="fert.camera_views"):
        store_encoder(small_settings(tmp_path, sim=SIM, fert=FERT.model_copy(update={"camera_views": ("wrist",)})))


def test_the_explorer_shows_a_failures_frames_beside_the_retrieved_ones(root, tmp_path) -> None:
    settings, stored, _ = root
    store = Workspace(settings).store
    built = build_training_set("fert", EpisodeList(stored), settings.fert, store, store.load_encoder(), seed=0)
    record = RetrievalRecord.from_training_set(built, 0, settings.store.window)
    out = tmp_path / "explain"
    result = explain(record, stored, stages(SIM), workspace_view(SIM), settings.explain, out)
    strips = [f for f in result.files if f.startswith("frames/")]
    assert strips and all((out / f).exists() for f in strips)
    page = result.pages[0]
    first = page.failures_shown[0]
    name = f"frames/{page.path.split('/')[0]}-{page.path.split('/')[1][:-4]}-{first[:8]}.png"
    image = matplotlib.image.imread(out / name)
    rows = 1 + min(settings.explain.windows_shown, len({(m.episode_id, m.start) for m in record.matches_of(first)}))
    assert image.shape[:2] == (THUMB_GAP + rows * (SIZE + THUMB_GAP),
                               THUMB_BAR + THUMB_GAP + len(KEYS) * THUMB_FRAMES * (SIZE + THUMB_GAP))
    # the failure's row shows its own frames from the divergence on
    failed = next(ep for ep in stored if ep.episode_id == first)
    step = next(f.divergence_step for f in record.failures if f.episode_id == first)
    tile = (image[THUMB_GAP: THUMB_GAP + SIZE, THUMB_BAR + THUMB_GAP: THUMB_BAR + THUMB_GAP + SIZE, :3] * 255).round()
    assert np.array_equal(tile.astype(np.uint8), failed.cameras[KEYS[0]][min(step, failed.length - 1)])
    # without camera frames the pages are drawn as before, with no strips
    plain = explain(record, [dataclasses.replace(ep, cameras={}) for ep in stored], stages(SIM), workspace_view(SIM),
                    settings.explain, tmp_path / "plain")
    assert not any(f.startswith("frames/") for f in plain.files)
