"""FERT on constructed episodes with a real LanceDB store: divergence, retrieval, weights, pools."""

from __future__ import annotations

import numpy as np
import pytest

from components.config import FertConfig, StoreConfig
from components.episodes.record import Episode
from components.fert import (
    DEMO_VERSION,
    FrameTable,
    Retrieved,
    build_training_set,
    calibrate_threshold,
    failure_contexts,
    first_divergence,
    priority_weights,
    retrieve,
)
from components.fert.mixing import pool_shares, sampling_probabilities
from components.store.encoder import NormalizedStateEncoder
from components.store.segment_store import SegmentStore
from components.store.windows import cut_windows

STORE = StoreConfig(window=4, stride=2)
T = 40
DIVERGE_AT = 20


def _episode(i: int, states: np.ndarray, success: bool, version: str = "v1", robot: str | None = None) -> Episode:
    t = len(states)
    actions = np.tile(np.array([[1.0, 0.0]], np.float32), (t, 1)) if success else np.full((t, 2), -9.0, np.float32)
    return Episode(
        episode_id=f"ep-{i:04d}", robot_id=robot or f"robot-{i % 5:04d}", task="t", states=states.astype(np.float32),
        actions=actions, timestamps=np.arange(t, dtype=np.float32) / 10, success=success, policy_version=version,
    )


def _path(rng: np.random.Generator, diverge_at: int | None = None) -> np.ndarray:
    """A 2-D state moving along x; a failure leaves the success corridor in y from ``diverge_at``."""
    x = np.linspace(0.0, 1.0, T)
    y = rng.normal(0.0, 0.01, T)
    if diverge_at is not None:
        y[diverge_at:] += np.linspace(0.3, 1.0, T - diverge_at)
    return np.stack([x + rng.normal(0, 0.01, T), y], axis=1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    rng = np.random.default_rng(0)
    successes = [_episode(i, _path(rng), True, DEMO_VERSION if i < 5 else "v1") for i in range(60)]
    failures = [_episode(100 + i, _path(rng, DIVERGE_AT), False) for i in range(6)]
    episodes = successes + failures
    windows = np.concatenate([cut_windows(e.states, STORE.window, STORE.stride).windows for e in episodes])
    encoder = NormalizedStateEncoder(STORE.window, 2).fit(windows)
    store = SegmentStore.open(tmp_path_factory.mktemp("fert") / "segments.lance", STORE, encoder.dim)
    store.upsert(episodes, encoder, snapshot="s")
    return store, encoder, successes, failures


def test_first_divergence_needs_k_consecutive_windows():
    d = np.array([0, 5, 0, 5, 5, 0, 5, 5, 5, 5], float)
    assert first_divergence(d, 1.0, 1) == 1
    assert first_divergence(d, 1.0, 2) == 3
    assert first_divergence(d, 1.0, 3) == 6
    assert first_divergence(d, 1.0, 5) is None
    assert first_divergence(np.zeros(0), 1.0, 2) is None


def test_calibration_keeps_false_fires_on_held_out_successes_low(world):
    store, encoder, successes, _ = world
    cfg = FertConfig(percentile=80.0, consecutive=1, max_false_fire=0.1, calibration_episodes=40)
    threshold = calibrate_threshold(store, encoder, successes, cfg, seed=0)
    assert threshold.false_fire_rate <= 0.1
    # an 80th-percentile threshold fires on single windows of most successes: k must have been raised
    assert threshold.consecutive > 1
    uncalibrated = calibrate_threshold(store, encoder, successes, cfg.model_copy(update={"calibrate": False}), seed=0)
    assert uncalibrated.consecutive == 1 and uncalibrated.false_fire_rate > threshold.false_fire_rate


def test_divergence_found_where_the_constructed_failure_leaves_the_successes(world):
    store, encoder, successes, failures = world
    cfg = FertConfig(calibration_episodes=40)
    threshold = calibrate_threshold(store, encoder, successes, cfg, seed=0)
    contexts = failure_contexts(store, encoder, failures, threshold, cfg)
    assert [c.episode_id for c in contexts] == [f.episode_id for f in failures]
    for context in contexts:
        assert not context.fallback
        # the first window reaching past the divergence point starts within one window of it
        assert DIVERGE_AT - STORE.window <= context.divergence_step <= DIVERGE_AT + STORE.stride
        assert (context.starts >= context.divergence_step).all()
        assert (context.distances > threshold.distance).sum() >= threshold.consecutive


def test_no_divergence_falls_back_to_the_last_steps(world):
    store, encoder, successes, _ = world
    cfg = FertConfig(calibration_episodes=40, fallback_steps=8)
    threshold = calibrate_threshold(store, encoder, successes, cfg, seed=0)
    # a "failure" that looks exactly like the successes (e.g. a late drop the states do not show)
    quiet = _episode(900, _path(np.random.default_rng(9)), False)
    (context,) = failure_contexts(store, encoder, [quiet], threshold, cfg)
    assert context.fallback and context.divergence_step == T - 8
    ends = context.starts + STORE.window
    assert (ends > T - 8).all() and len(context.starts) > 0
    with pytest.raises(ValueError, match="succeeded"):
        failure_contexts(store, encoder, [successes[0]], threshold, cfg)


def test_retrieval_never_returns_failed_episodes(world):
    store, encoder, successes, failures = world
    cfg = FertConfig(calibration_episodes=40, top_k=8, max_distance_percentile=100.0)
    threshold = calibrate_threshold(store, encoder, successes, cfg, seed=0)
    contexts = failure_contexts(store, encoder, failures, threshold, cfg)
    # the failures' own windows are the nearest rows in the store, yet none may come back
    retrieved = retrieve(store, contexts, cfg, task="t", seed=0)
    assert len(retrieved) > 0
    failed_ids = {f.episode_id for f in failures}
    success_ids = {s.episode_id for s in successes}
    assert not failed_ids & set(retrieved.episode_ids.tolist())
    assert set(retrieved.episode_ids.tolist()) <= success_ids
    assert len(set(retrieved.robot_ids.tolist())) > 1  # matches come from other robots too
    starts = {c.episode_id: set(c.starts.tolist()) for c in contexts}  # each match names its query window
    assert all(s in starts[f] for f, s in zip(retrieved.query_episode_ids, retrieved.query_starts, strict=True))
    kept = retrieve(store, contexts, cfg.model_copy(update={"max_distance_percentile": 50.0}), task="t", seed=0)
    assert kept.dropped > 0 and kept.distances.max() <= kept.cutoff


def test_priority_weights_follow_the_formula():
    episodes = [_episode(i, np.zeros((10, 2)), True) for i in range(2)]
    table = FrameTable.from_episodes(episodes, DEMO_VERSION)
    # two queries hit frames 2..5 of episode 0 (d=1 and d=2); one hits frames 0..3 of episode 1 (d=0)
    retrieved = Retrieved(
        query=np.array([0, 1, 1]), query_episode_ids=np.array(["f", "f", "f"], dtype=object), query_starts=np.array([0, 4, 4]),
        episode_ids=np.array(["ep-0000", "ep-0000", "ep-0001"], dtype=object),
        robot_ids=np.array(["a", "a", "b"], dtype=object), starts=np.array([2, 2, 0]), ends=np.array([6, 6, 4]),
        distances=np.array([1.0, 4.0, 0.0]), metric="l2", num_queries=2, cutoff=4.0, dropped=0, store_version=1,
    )  # l2 distances are squared: plain lengths 1, 2, 0
    w = priority_weights(table, retrieved, alpha=2.0, sigma=1.0)
    expected = np.ones(20)
    expected[2:6] += 2.0 * (np.exp(-1 / 2) + np.exp(-4 / 2))
    expected[10:14] += 2.0 * 1.0
    np.testing.assert_allclose(w.weights, expected)
    assert w.retrieved.sum() == 8
    uniform = priority_weights(table, retrieved, alpha=2.0, sigma=1.0, uniform=True)
    np.testing.assert_array_equal(uniform.weights, np.ones(20))
    np.testing.assert_array_equal(uniform.retrieved, w.retrieved)
    assert priority_weights(table, retrieved, alpha=1.0).sigma == pytest.approx(1.0)  # median of 1, 2, 0
    # credit_lead: each match credits what its episode did next, clipped at the episode's end
    led = priority_weights(table, retrieved, alpha=2.0, sigma=1.0, lead=5)
    expected = np.ones(20)
    expected[7:10] += 2.0 * (np.exp(-1 / 2) + np.exp(-4 / 2))  # frames 7..10 of episode 0, cut at its 10 frames
    expected[15:19] += 2.0 * 1.0
    np.testing.assert_allclose(led.weights, expected)
    assert led.retrieved.sum() == 3 + 4
    missing = Retrieved(**{**retrieved.__dict__, "episode_ids": np.array(["x", "x", "x"], dtype=object)})
    with pytest.raises(ValueError, match="not among the successful"):
        priority_weights(table, missing, alpha=1.0)


def test_pool_mix_gives_each_pool_its_share():
    demo = _episode(0, np.zeros((10, 2)), True, DEMO_VERSION)
    fleet = [_episode(i, np.zeros((30, 2)), True) for i in (1, 2)]
    table = FrameTable.from_episodes([demo, *fleet], DEMO_VERSION)
    weights = np.ones(len(table))
    weights[40:50] = 3.0
    retrieved_mask = np.zeros(len(table), bool)
    retrieved_mask[40:60] = True
    from components.fert.priority import PriorityWeights

    priority = PriorityWeights(weights, retrieved_mask, 1.0, 1.0, False)
    cfg = FertConfig(mix_demos=0.2, mix_successes=0.4, mix_retrieved=0.4)
    shares = pool_shares(cfg, 10, len(table), 20)
    p = sampling_probabilities(table, priority, shares)
    assert p.sum() == pytest.approx(1.0)
    assert p[:10].sum() == pytest.approx(0.2 + 0.4 * 10 / 70)  # demos: own share + their part of all successes
    assert p[40:50].sum() == pytest.approx(0.4 * 10 / 70 + 0.4 * 30 / 40)  # w = 3 frames get 3/4 of the retrieved pool
    assert p[50:60].sum() == pytest.approx(0.4 * 10 / 70 + 0.4 * 10 / 40)
    nothing = pool_shares(cfg, 10, len(table), 0)
    assert nothing.retrieved == 0 and nothing.demos == pytest.approx(1 / 3)


def test_methods_never_imitate_failed_episodes(world):
    store, encoder, successes, failures = world
    episodes = successes + failures
    cfg = FertConfig(calibration_episodes=40)
    bc = build_training_set("bc", episodes, cfg)
    assert len(bc.data.states) == 5 * T and bc.data.weights is None  # the 5 demos only, uniform
    filtered = build_training_set("filtered_bc", episodes, cfg)
    assert len(filtered.data.states) == 60 * T
    fert = build_training_set("fert", episodes, cfg, store, encoder, seed=0)
    for built in (bc, filtered, fert):
        assert not (built.data.actions == -9.0).any()  # failed episodes' actions never appear
    assert fert.report.failed_episodes == 6 and fert.report.matches > 0
    assert fert.data.weights.sum() == pytest.approx(1.0)
    assert fert.report.retrieved_mass > fert.report.retrieved_frames / fert.report.frames  # retrieval is emphasized
    uniform = build_training_set("fert_uniform", episodes, cfg, store, encoder, seed=0)
    np.testing.assert_array_equal(uniform.priority.retrieved, fert.priority.retrieved)
    assert np.unique(uniform.data.weights[uniform.priority.retrieved]).size <= 3  # no similarity weighting
    with pytest.raises(ValueError, match="needs the segment store"):
        build_training_set("fert", episodes, cfg)
    with pytest.raises(ValueError, match="unknown"):
        build_training_set("dagger", episodes, cfg)


def test_learned_encoder_is_deterministic_round_trips_and_ignores_what_actions_do_not_need(tmp_path):
    from components.fert.encoder import ActionPredictiveEncoder
    from components.store.encoder import encoder_from_state_dict

    rng = np.random.default_rng(1)
    # state = (placement, phase): the action depends on the phase only
    placement = rng.uniform(-5, 5, (600, 4, 1))
    phase = rng.choice([-1.0, 1.0], (600, 1, 1)) * np.ones((1, 4, 1))
    windows = np.concatenate([placement, phase], axis=2).astype(np.float32)
    actions = np.repeat(phase, 2, axis=2)
    a = ActionPredictiveEncoder(4, 2, dim=4, epochs=30, seed=0).fit_supervised(windows, actions)
    b = ActionPredictiveEncoder(4, 2, dim=4, epochs=30, seed=0).fit_supervised(windows, actions)
    np.testing.assert_array_equal(a.encode(windows), b.encode(windows))  # seeded: bit-identical
    rebuilt = encoder_from_state_dict(a.state_dict())  # registered with the store by kind
    np.testing.assert_array_equal(rebuilt.encode(windows), a.encode(windows))
    codes = a.encode(windows)
    same_phase = phase[:, 0, 0] == phase[0, 0, 0]
    # windows needing the same action are closer than windows needing another, whatever their placement
    d = np.linalg.norm(codes - codes[0], axis=1)
    assert np.median(d[same_phase][1:]) < np.median(d[~same_phase])
    store = SegmentStore.open(tmp_path / "s.lance", StoreConfig(window=4, stride=2), a.dim)
    episode = _episode(0, np.zeros((12, 2)), True)
    store.upsert([episode], a, snapshot="s")
    assert isinstance(store.load_encoder(), ActionPredictiveEncoder)
    assert ActionPredictiveEncoder(4, 2, dim=3, epochs=1).fit(windows).encode(windows).shape == (600, 3)


def _hover_then_release(i: int, hover: int) -> Episode:
    """Approach along x, hover ``hover`` frames at the goal with the jaw closed, then release."""
    approach = np.stack([np.linspace(0.0, 0.9, 10), np.zeros(10)], axis=1)
    states = np.concatenate([approach, np.tile([[1.0, 0.0]], (hover + 1, 1))]).astype(np.float32)
    jaw = np.concatenate([np.ones(10 + hover), [-1.0]]).astype(np.float32)  # +1 keep closed, -1 open
    actions = np.stack([np.zeros_like(jaw), jaw], axis=1)
    return Episode(
        episode_id=f"hover-{i}", robot_id="robot-0001", task="t", states=states, actions=actions,
        timestamps=np.arange(len(states), dtype=np.float32) / 10, success=True, policy_version="v1",
    )


def test_loop_removal_keeps_only_the_last_visit_of_a_state():
    from components.fert.revisits import imitated_frames, revisited, state_scale

    line = np.stack([np.linspace(0.0, 1.0, 12), np.zeros(12)], axis=1)
    assert not revisited(line, 0.2, state_scale(line)).any()  # a path that keeps moving has no detour
    loop = np.concatenate([line[:6], line[5::-1], line])  # out, back, out again
    marked = revisited(loop, 0.05, state_scale(loop))
    assert marked[:12].all() and not marked[12:].any()  # the first pass and the way back were detours
    np.testing.assert_array_equal(imitated_frames([line, loop], 0.0), np.ones(36, bool))  # radius 0 = off
    with pytest.raises(ValueError, match="revisit_radius"):
        imitated_frames([line], -1.0)


def test_loop_removal_turns_hovering_successes_into_release_labels():
    """k x "keep closed" then 1 x "open" at the goal: imitation would learn to keep closed."""
    episodes = [_hover_then_release(i, hover) for i, hover in enumerate((2, 5, 9))]
    at_goal = lambda table: (table.states[:, 0] == 1.0)  # noqa: E731
    plain = FrameTable.from_episodes(episodes, DEMO_VERSION)
    assert plain.actions[at_goal(plain), 1].mean() > 0.5  # most goal frames say "keep closed"
    table = FrameTable.from_episodes(episodes, DEMO_VERSION, revisit_radius=0.1)
    kept = table.drawable & at_goal(table)
    np.testing.assert_array_equal(table.actions[kept, 1], [-1.0, -1.0, -1.0])  # only the releases remain
    assert table.removed_frames == 2 + 5 + 9
    cfg = FertConfig(revisit_radius=0.1)
    built = build_training_set("filtered_bc", episodes, cfg)
    assert built.report.removed_frames == 16 and built.report.frames == len(table) - 16
    assert built.data.weights[~table.drawable].sum() == 0 and built.data.weights.sum() == pytest.approx(1.0)
