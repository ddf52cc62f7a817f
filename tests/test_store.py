"""Segment store: windows, encoder, idempotent upsert, filtered kNN, index threshold, versions.

Real LanceDB directories in tmp_path; no mocks.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from components.config import StoreConfig
from components.episodes.record import Episode, new_episode_id
from components.store import (
    NormalizedStateEncoder,
    SegmentStore,
    cut_windows,
    encoder_fingerprint,
    episode_windows,
    encoder_from_state_dict,
    window_count,
    window_starts,
)
from components.store.index_plan import IVF_MIN_ROWS, plan_index, plan_ivf_pq, search_params, sub_vectors_for
from components.store.segment_store import EmbedCursor

STATE_DIM = 4
# resident_index off: these tests are about LanceDB's own search path (the resident index that
# answers single queries by default has its tests in test_resident_index.py)
CFG = StoreConfig(window=8, stride=4, index_min_rows=256, index_sub_vectors=8, upsert_batch_rows=60,
                  resident_index=False)


def make_episode(rng: np.random.Generator, length: int = 30, success: bool = True,
                 robot_id: str = "robot-0000", task: str = "pick-place") -> Episode:
    states = np.cumsum(rng.standard_normal((length, STATE_DIM)), axis=0).astype(np.float32)
    return Episode(
        episode_id=new_episode_id(rng),
        robot_id=robot_id,
        task=task,
        states=states,
        actions=np.zeros((length, 2), dtype=np.float32),
        timestamps=np.arange(length, dtype=np.float32) / 10,
        success=success,
    )


def make_fleet(seed: int = 0, count: int = 24) -> list[Episode]:
    rng = np.random.default_rng(seed)
    return [
        make_episode(
            rng,
            length=int(rng.integers(20, 40)),
            success=i % 3 != 0,
            robot_id=f"robot-{i % 4:04d}",
            task="pick-place" if i % 2 else "push",
        )
        for i in range(count)
    ]


def fit_encoder(episodes: list[Episode], cfg: StoreConfig = CFG) -> NormalizedStateEncoder:
    windows = np.concatenate([episode_windows(e, cfg.window, cfg.stride)[1] for e in episodes])
    return NormalizedStateEncoder(cfg.window).fit(windows)


def sorted_rows(store: SegmentStore) -> pa.Table:
    return store._table.to_arrow().sort_by("segment_id")


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each row of ``truth`` (ids) that ``found`` holds."""
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]))


# ---------------------------------------------------------------------- windows


def test_windows_cover_episode_with_end_aligned_last_window() -> None:
    states = np.arange(30 * 2, dtype=np.float32).reshape(30, 2)
    cut = cut_windows(states, window=8, stride=4)
    assert cut.starts.tolist() == [0, 4, 8, 12, 16, 20, 22]
    assert cut.windows.shape == (7, 8, 2) and cut.windows.dtype == np.float32
    assert (cut.ends - cut.starts == 8).all() and cut.ends[-1] == 30
    for start, window in zip(cut.starts, cut.windows, strict=True):
        np.testing.assert_array_equal(window, states[start : start + 8])
    # already aligned: no extra window
    assert window_starts(28, 8, 4).tolist() == [0, 4, 8, 12, 16, 20]
    assert window_starts(8, 8, 4).tolist() == [0]
    for length, window, stride in ((1, 8, 4), (8, 8, 4), (9, 8, 4), (28, 8, 4), (30, 8, 4), (50, 8, 4), (97, 5, 3)):
        assert window_count(length, window, stride) == len(window_starts(length, window, stride))
    episode = Episode("e", "robot-0000", "pick-place", states, np.zeros((30, 1), np.float32),
                      np.arange(30, dtype=np.float32), True)
    starts, windows = episode_windows(episode, 8, 4)
    np.testing.assert_array_equal(starts, cut.starts)
    np.testing.assert_array_equal(windows, cut.windows)


def test_short_episode_is_front_padded_with_first_frame() -> None:
    states = np.arange(5 * 3, dtype=np.float32).reshape(5, 3) + 1
    cut = cut_windows(states, window=8, stride=4)
    assert cut.starts.tolist() == [0] and cut.ends.tolist() == [5]
    assert cut.windows.shape == (1, 8, 3)
    np.testing.assert_array_equal(cut.windows[0, :3], np.repeat(states[:1], 3, axis=0))
    np.testing.assert_array_equal(cut.windows[0, 3:], states)


def test_windows_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="observation.state"):
        cut_windows(np.zeros(10, dtype=np.float32), 8, 4)
    with pytest.raises(ValueError, match=">= 1 frame"):
        cut_windows(np.zeros((0, 3), dtype=np.float32), 8, 4)


# ---------------------------------------------------------------------- encoder


def test_encoder_is_deterministic_and_round_trips_through_json() -> None:
    episodes = make_fleet()
    windows = np.concatenate([cut_windows(e.states, 8, 4).windows for e in episodes])
    a, b = fit_encoder(episodes), fit_encoder(episodes)
    encoded = a.encode(windows)
    assert encoded.shape == (len(windows), 8 * STATE_DIM) and encoded.dtype == np.float32
    assert a.dim == 8 * STATE_DIM
    np.testing.assert_array_equal(encoded, b.encode(windows))
    # z-scored: per state dimension, mean ~0 and std ~1 over the fitted frames
    z = encoded.reshape(-1, STATE_DIM)
    np.testing.assert_allclose(z.mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(z.std(axis=0), 1, atol=1e-4)

    restored = encoder_from_state_dict(json.loads(json.dumps(a.state_dict())))
    np.testing.assert_array_equal(restored.encode(windows), encoded)
    assert encoder_fingerprint(restored) == encoder_fingerprint(a)
    other = NormalizedStateEncoder(8).fit(windows[: len(windows) // 2])
    assert encoder_fingerprint(other) != encoder_fingerprint(a)


def test_encoder_guards_constant_dims_and_misuse() -> None:
    windows = np.ones((10, 8, 2), dtype=np.float32)
    windows[:, :, 1] = np.arange(10, dtype=np.float32)[:, None]
    encoder = NormalizedStateEncoder(8).fit(windows)
    assert np.isfinite(encoder.encode(windows)).all()  # constant dim 0: std floored, no inf
    with pytest.raises(ValueError, match="before fit"):
        NormalizedStateEncoder(8).encode(windows)
    with pytest.raises(ValueError, match="state dim 3"):
        encoder.encode(np.zeros((2, 8, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="store.window=8"):
        encoder.encode(np.zeros((2, 4, 2), dtype=np.float32))


# ---------------------------------------------------------------------- upsert


def test_upsert_is_idempotent_and_no_op_keeps_the_version(tmp_path: Path) -> None:
    episodes = make_fleet()
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    progress: list[tuple[int, int]] = []
    first = store.upsert(
        episodes, encoder, snapshot="snap-a", on_progress=lambda d, t: progress.append((d, t))
    )
    expected = sum(len(cut_windows(e.states, 8, 4)) for e in episodes)
    assert first.inserted == first.segments == expected == store.count()
    assert first.commits > 1, "upsert_batch_rows=60 must split this into several commits"
    assert progress[-1] == (len(episodes), len(episodes))
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    assert store.version > first.version_before
    rows = sorted_rows(store)
    assert rows.column("segment_id").to_pylist()[0].count(":") == 1
    assert set(rows.column("snapshot").to_pylist()) == {"snap-a"}

    # same episodes again (even under a new snapshot, with duplicates in the batch): no-op
    again = store.upsert(episodes + episodes[:5], encoder, snapshot="snap-b")
    assert again.duplicate_episodes == 5 and again.episodes == len(episodes)
    assert again.inserted == again.updated == again.commits == 0
    assert again.unchanged == expected and not again.changed
    assert again.version_after == again.version_before == store.version
    assert sorted_rows(store).equals(rows)


def test_precomputed_rows_merge_like_upsert(tmp_path: Path) -> None:
    """Embedding can fan out (segment_rows per file) and one writer merge (upsert_rows)."""
    episodes = make_fleet(seed=3, count=10)
    encoder = fit_encoder(episodes)
    direct = SegmentStore.open(tmp_path / "direct", CFG, encoder.dim)
    direct.upsert(episodes, encoder, snapshot="s")
    fanned = SegmentStore.open(tmp_path / "fanned", CFG, encoder.dim)
    parts = [fanned.segment_rows([ep], encoder, snapshot="s") for ep in episodes]
    report = fanned.upsert_rows(pa.concat_tables(parts + parts[:2]), encoder)  # repeats deduped
    assert report.inserted == direct.count() == fanned.count()
    assert report.episodes == len(episodes)
    assert sorted_rows(fanned).equals(sorted_rows(direct))
    again = fanned.upsert_rows(pa.concat_tables(parts), encoder)
    assert again.commits == 0 and again.version_after == again.version_before
    other = fit_encoder(make_fleet(seed=4, count=10))  # same dim, other statistics
    with pytest.raises(ValueError, match="fingerprint"):
        fanned.upsert_rows(pa.concat_tables(parts), other)


def test_changed_label_updates_rows_and_moves_the_version(tmp_path: Path) -> None:
    episodes = make_fleet()
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    before = store.version
    relabelled = Episode(**{**episodes[0].__dict__, "success": not episodes[0].success})
    report = store.upsert([relabelled, *episodes[1:3]], encoder, snapshot="snap-b")
    n = len(cut_windows(relabelled.states, 8, 4))
    assert report.updated == n and report.inserted == 0 and report.unchanged > 0
    assert store.version > before
    changed = store._table.search().where(f"episode_id = '{relabelled.episode_id}'").to_arrow()
    assert set(changed.column("success").to_pylist()) == {relabelled.success}
    assert set(changed.column("snapshot").to_pylist()) == {"snap-b"}
    assert store.count() == sum(len(cut_windows(e.states, 8, 4)) for e in episodes)


def test_bad_input_raises_clearly_and_writes_nothing(tmp_path: Path) -> None:
    episodes = make_fleet()
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    store.upsert(episodes[:10], encoder, snapshot="snap-a")
    version, rows = store.version, sorted_rows(store)

    wrong_dim = NormalizedStateEncoder(4).fit(np.zeros((3, 4, STATE_DIM), dtype=np.float32))
    with pytest.raises(ValueError, match=r"encoder.dim=16 .*'vector'.*dim=32"):
        store.upsert(episodes, wrong_dim, snapshot="snap-b")
    refit = fit_encoder(episodes[:5])
    with pytest.raises(ValueError, match="fingerprint .*load_encoder"):
        store.upsert(episodes, refit, snapshot="snap-b")
    nan_states = episodes[12].states.copy()
    nan_states[3, 1] = np.nan
    bad = Episode(**{**episodes[12].__dict__, "states": nan_states})
    with pytest.raises(ValueError, match=f"{bad.episode_id}.*finite"):
        store.upsert([*episodes[10:12], bad], encoder, snapshot="snap-b")
    wide_states = np.zeros((30, STATE_DIM + 1), np.float32)
    wide = Episode(**{**episodes[13].__dict__, "states": wide_states})
    with pytest.raises(ValueError, match="mix observation.state dims"):
        store.upsert([episodes[11], wide], encoder, snapshot="snap-b")
    with pytest.raises(ValueError, match=r"\(Q, 32\)"):
        store.search(np.zeros((2, 31), dtype=np.float32), k=3)
    with pytest.raises(ValueError, match="has dim 32, but dim=16 was asked"):
        SegmentStore.open(tmp_path / "segments", CFG, 16)

    assert store.version == version
    assert sorted_rows(store).equals(rows)
    # the store remembers its encoder, so the fix the message names works
    assert encoder_fingerprint(store.load_encoder()) == store.encoder_fingerprint()


class FailingEncoder(NormalizedStateEncoder):
    """Fails on its second encode call, like a crash half-way through a large upsert."""

    calls = 0

    def encode(self, windows: np.ndarray) -> np.ndarray:
        FailingEncoder.calls += 1
        if FailingEncoder.calls == 2:
            raise RuntimeError("encoder crashed")
        return super().encode(windows)


def test_failed_upsert_leaves_a_valid_table_and_rerun_completes(tmp_path: Path) -> None:
    episodes = make_fleet()
    encoder = fit_encoder(episodes)
    failing = FailingEncoder.from_state_dict(encoder.state_dict())
    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    with pytest.raises(RuntimeError, match="crashed"):
        store.upsert(episodes, failing, snapshot="snap-a")
    partial = store.count()
    assert 0 < partial < sum(len(cut_windows(e.states, 8, 4)) for e in episodes)
    report = store.upsert(episodes, encoder, snapshot="snap-a")
    assert report.unchanged == partial
    clean = SegmentStore.open(tmp_path / "clean", CFG, encoder.dim)
    clean.upsert(episodes, encoder, snapshot="snap-a")
    assert sorted_rows(store).equals(sorted_rows(clean))


# ---------------------------------------------------------------------- search


def test_search_filters_and_exclusions(tmp_path: Path) -> None:
    episodes = make_fleet(count=30)
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    failed = [e for e in episodes if not e.success]
    queries = encoder.encode(np.concatenate([episode_windows(e, 8, 4)[1] for e in failed[:3]]))

    exact = store.search(queries, k=5)
    assert exact.distances.shape == (len(queries), 5)
    np.testing.assert_allclose(exact.distances[:, 0], 0, atol=1e-4)  # each query finds itself
    assert (np.diff(exact.distances, axis=1) >= 0).all()

    ok = store.search(queries, k=10, success=True)
    assert ok.counts.tolist() == [10] * len(queries) and ok.success.all()
    failed_ids = {e.episode_id for e in failed}
    assert not failed_ids & set(ok.episode_ids.ravel())

    push = store.search(queries, k=10, task="push", robot_id="robot-0002")
    allowed = {e.episode_id for e in episodes if e.task == "push" and e.robot_id == "robot-0002"}
    assert set(push.episode_ids[push.valid]) <= allowed and push.valid.any()
    assert set(push.robot_ids[push.valid]) == {"robot-0002"}

    excluded = [e.episode_id for e in episodes[:20]]
    rest = store.search(queries, k=500, exclude_episode_ids=excluded)
    kept = sum(len(cut_windows(e.states, 8, 4)) for e in episodes[20:])
    assert rest.counts.tolist() == [kept] * len(queries)  # fewer than k: padded
    assert not set(excluded) & set(rest.episode_ids[rest.valid])
    assert (rest.starts[~rest.valid] == -1).all() and np.isinf(rest.distances[~rest.valid]).all()

    nothing = store.search(queries[:2], k=3, task="no-such-task")
    assert nothing.counts.tolist() == [0, 0]


def test_index_needs_enough_rows_and_keeps_filters(tmp_path: Path) -> None:
    episodes = make_fleet(count=60)
    encoder = fit_encoder(episodes)
    small = SegmentStore.open(tmp_path / "small", CFG, encoder.dim)
    small.upsert(episodes[:10], encoder, snapshot="snap-a")
    assert small.count() < CFG.index_min_rows
    assert small.ensure_index() is False and not small.has_index()

    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    assert store.count() >= CFG.index_min_rows
    assert store.ensure_index() is True and store.has_index()
    indexed = {idx.columns[0]: idx.index_type for idx in store._table.list_indices()}
    assert indexed["vector"] == "IvfPq" and indexed["episode_id"] == "BTree"  # store.index_type's default
    assert indexed["success"] == "Bitmap"
    version = store.version
    assert store.ensure_index() is True and store.version == version  # already there: no write
    queries = encoder.encode(cut_windows(episodes[0].states, 8, 4).windows)
    indexed = store.search(queries, k=5, success=True)
    assert indexed.success.all() and indexed.counts.tolist() == [5] * len(queries)
    brute = store.search(queries, k=5, success=True, exact=True)
    # refine_factor re-ranks with exact distances, so the top hit agrees with brute force here
    np.testing.assert_allclose(indexed.distances[:, 0], brute.distances[:, 0], rtol=1e-5)
    # queries go to LanceDB a few at a time (bounded memory): the same hits in the same order
    batched = SegmentStore.open(tmp_path / "segments", CFG.model_copy(update={"search_batch_queries": 3}), encoder.dim)
    assert len(queries) > 3
    for exact, one_call in ((False, indexed), (True, brute)):
        got = batched.search(queries, k=5, success=True, exact=exact)
        assert (got.segment_ids == one_call.segment_ids).all() and (got.counts == one_call.counts).all()
        np.testing.assert_array_equal(got.distances, one_call.distances)
    # new rows are searchable before optimize (flat over the unindexed part) and after it
    extra = make_fleet(seed=1, count=2)
    store.upsert(extra, encoder, snapshot="snap-b")
    probe = encoder.encode(cut_windows(extra[0].states, 8, 4).windows[:1])
    assert store.search(probe, k=1).episode_ids[0, 0] == extra[0].episode_id
    store.optimize()
    assert store.search(probe, k=1).episode_ids[0, 0] == extra[0].episode_id
    # an index built with another metric would make queries silently scan flat: refuse
    cosine = SegmentStore.open(tmp_path / "segments", CFG.model_copy(update={"metric": "cosine"}), 32)
    with pytest.raises(ValueError, match="uses metric 'l2' but store.metric is 'cosine'"):
        cosine.ensure_index()


def test_vector_index_can_wait_past_index_min_rows(tmp_path: Path) -> None:
    """store.vector_index_min_rows above index_min_rows: ingest builds LanceDB's vector index only
    from there (with the resident index on, it answers single queries only above
    resident_max_rows); the filter columns are indexed (and folded) from index_min_rows as before."""
    first, second = make_fleet(count=60), make_fleet(seed=1, count=60)
    encoder = fit_encoder(first)
    probe = SegmentStore.open(tmp_path / "probe", CFG, encoder.dim)
    probe.upsert(first, encoder, snapshot="snap-a")
    rows = probe.count()
    cfg = CFG.model_copy(update={"resident_index": True, "resident_max_rows": 2 * (rows + 200), "index_fold_rows": 100,
                                 "vector_index_min_rows": rows + 200})
    assert cfg.vector_index_rows == rows + 200 and rows > cfg.index_min_rows
    store = SegmentStore.open(tmp_path / "segments", cfg, encoder.dim)
    store.upsert(first, encoder, snapshot="snap-a")
    assert store.ensure_index() is False and not store.has_index()
    indexed = {idx.columns[0]: idx.index_type for idx in store._table.list_indices()}
    assert indexed == {"episode_id": "BTree", "success": "Bitmap", "task": "Bitmap", "robot_id": "Bitmap"}
    queries = encoder.encode(cut_windows(first[0].states, 8, 4).windows)
    resident, exact = store.search(queries[:2], k=5, success=True), store.search(queries[:2], k=5, success=True, exact=True)
    np.testing.assert_array_equal(resident.segment_ids, exact.segment_ids)
    # the filter columns' indexes take new rows in once index_fold_rows are unindexed
    store.upsert(second[:20], encoder, snapshot="snap-b")
    assert store.count() - rows >= cfg.index_fold_rows
    assert store.count() < cfg.vector_index_rows and store.ensure_index() is False
    stats = store._table.index_stats(next(i.name for i in store._table.list_indices() if i.columns == ["episode_id"]))
    assert stats.num_unindexed_rows < cfg.index_fold_rows
    store.upsert(second[20:], encoder, snapshot="snap-c")
    assert store.count() >= cfg.vector_index_rows
    assert store.ensure_index() is True and store.index_type() == "IVF_PQ"


def test_a_vector_index_threshold_past_the_resident_limit_is_refused() -> None:
    assert StoreConfig().vector_index_rows == StoreConfig().index_min_rows  # unset: built with the scalar indexes
    with pytest.raises(ValueError, match=r"store.vector_index_min_rows=6,000,000 is above store.resident_max_rows"):
        StoreConfig(vector_index_min_rows=6_000_000)
    assert StoreConfig(vector_index_min_rows=6_000_000, resident_index=False).vector_index_rows == 6_000_000


# ---------------------------------------------------------------------- handles & versions


def _upsert_in_child(uri: str, seed: int) -> None:
    episodes = make_fleet(seed=seed, count=3)
    store = SegmentStore.open(Path(uri), CFG, 8 * STATE_DIM)
    store.upsert(episodes, store.load_encoder(), snapshot="child")


def test_handles_see_other_writers_and_checkout_time_travels(tmp_path: Path) -> None:
    episodes = make_fleet()
    encoder = fit_encoder(episodes)
    uri = tmp_path / "segments"
    writer = SegmentStore.open(uri, CFG, encoder.dim)
    reader = SegmentStore.open(uri, CFG, encoder.dim)
    writer.upsert(episodes[:5], encoder, snapshot="snap-a")
    assert reader.count() == writer.count() > 0 and reader.version == writer.version
    tagged = writer.tag("round-1")
    count_before = writer.count()

    # another process (spawn: never fork after using LanceDB)
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=_upsert_in_child, args=(str(uri), 7))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    child_ids = {e.episode_id for e in make_fleet(seed=7, count=3)}
    assert reader.count() == writer.count() > count_before and reader.version > tagged
    assert child_ids <= set(reader._table.to_arrow().column("episode_id").to_pylist())

    past = writer.checkout("round-1")
    assert past.version == tagged and past.read_only
    assert past.count() == sum(len(cut_windows(e.states, 8, 4)) for e in episodes[:5])
    assert writer.tags() == {"round-1": tagged}
    with pytest.raises(ValueError, match="read-only view"):
        past.upsert(episodes, encoder, snapshot="snap-b")


def test_a_step_handle_reads_its_version_and_writes_on_the_latest(tmp_path: Path) -> None:
    """consistency="step" (an ingest's handle): reads stay at the version it opened at plus its
    own writes, but each write moves to the latest first, so another process's rows are never
    inserted twice or lost, and a cursor another writer recorded is seen before it is replaced."""
    episodes = make_fleet()
    encoder = fit_encoder(episodes)
    uri = tmp_path / "segments"
    SegmentStore.open(uri, CFG, encoder.dim).upsert(episodes[:5], encoder, snapshot="a")
    step = SegmentStore.open(uri, CFG, encoder.dim, consistency="step")
    opened_at, first = step.version, step.count()

    child = multiprocessing.get_context("spawn").Process(target=_upsert_in_child, args=(str(uri), 7))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    strong = SegmentStore.open(uri, CFG, encoder.dim)
    child_rows = strong.count() - first
    assert child_rows > 0
    assert (step.version, step.count()) == (opened_at, first), "a step handle reads the version it opened at"

    again = step.upsert(make_fleet(seed=7, count=3), encoder, snapshot="child")  # the child's own episodes
    assert again.inserted == 0 and again.unchanged == again.segments, "the write looked up the latest rows"
    mine = step.upsert(episodes[5:8], encoder, snapshot="b")
    assert mine.inserted > 0
    assert step.count() == strong.count() == first + child_rows + mine.inserted
    assert len(set(sorted_rows(strong).column("segment_id").to_pylist())) == strong.count()
    assert {e.episode_id for e in make_fleet(seed=7, count=3)} <= set(sorted_rows(step).column("episode_id").to_pylist())

    strong.set_embed_cursor(EmbedCursor(episodes=8, last_episode_id=episodes[7].episode_id, rows=strong.count()))
    step.set_embed_cursor(EmbedCursor(episodes=8, last_episode_id=episodes[7].episode_id, rows=strong.count()))
    assert step.version == strong.version, "an unchanged cursor (read on the latest version) commits nothing"
    with pytest.raises(ValueError, match="consistency"):
        SegmentStore.open(uri, CFG, encoder.dim, consistency="eventual")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- index sizes & upkeep


def test_sub_vectors_divide_any_width() -> None:
    assert sub_vectors_for(80, 16) == 16  # configured value divides: kept
    assert sub_vectors_for(88, 16) == 22  # default sim: 8 x 11; 4 dims each, nearest to 88/16 = 5.5
    assert sub_vectors_for(88, 8) == 8
    assert sub_vectors_for(89, 16) in (1, 89)  # a prime has no divisor in 4-16 dims: still divides
    for dim in range(1, 300):
        chosen = sub_vectors_for(dim, 16)
        assert dim % chosen == 0
        if any(4 <= dim // d <= 16 for d in range(1, dim + 1) if dim % d == 0) and dim % 16:
            assert 4 <= dim // chosen <= 16
    plan = plan_ivf_pq(88, 1000, StoreConfig())
    assert plan.derived and plan.sub_vectors == 22 and plan.partitions == 1000 // 256


def test_index_plan_follows_the_type_and_the_rows_and_search_follows_the_built_index() -> None:
    cfg = StoreConfig(index_type="IVF_HNSW_SQ", hnsw_partition_rows=16_000)
    plan = plan_index(88, 1_000_000, cfg)
    assert plan.kind == "IVF_HNSW_SQ" and plan.partitions == -(-1_000_000 // 16_000)
    assert plan_index(88, 3 * IVF_MIN_ROWS, cfg).partitions == 1  # fewer rows than one partition wants
    assert plan_index(88, 1_000_000, cfg.model_copy(update={"index_type": "IVF_PQ"})).kind == "IVF_PQ"
    # a table keeps being searched with the keys of the index it has, whatever store.index_type says
    assert search_params("IVF_PQ", 10, cfg).refine_factor == cfg.refine_factor and search_params("IVF_PQ", 10, cfg).ef is None
    hnsw = search_params("IVF_HNSW_SQ", 10, cfg)
    assert (hnsw.nprobes, hnsw.refine_factor) == (cfg.hnsw_nprobes, cfg.hnsw_refine_factor)
    assert search_params("IVF_HNSW_SQ", cfg.hnsw_ef + 5, cfg).ef == cfg.hnsw_ef + 5  # never narrower than k


def test_index_builds_train_with_the_configured_kmeans_iterations() -> None:
    # LanceDB's default is 50; store.index_max_iterations reaches both index types' build config
    for index_type in ("IVF_PQ", "IVF_HNSW_SQ"):
        cfg = StoreConfig(index_type=index_type, index_max_iterations=7)
        assert plan_index(88, 100_000, cfg).index_config("l2").max_iterations == 7


def _sim_width_fleet(seed: int, count: int) -> list[Episode]:
    """Episodes with the default simulator's 11-dim state: windows of 8 x 11 = 88 values."""
    rng = np.random.default_rng(seed)
    return [
        Episode(
            episode_id=new_episode_id(rng), robot_id=f"robot-{i % 4:04d}", task="pick-place",
            states=np.cumsum(rng.standard_normal((30, 11)), axis=0).astype(np.float32),
            actions=np.zeros((30, 4), dtype=np.float32),
            timestamps=np.arange(30, dtype=np.float32) / 10, success=i % 3 != 0,
        )
        for i in range(count)
    ]


def test_store_with_sim_width_keeps_ingesting_past_the_index_threshold(tmp_path: Path) -> None:
    # the default index_sub_vectors (16) does not divide 88: the store must derive a divisor
    cfg = StoreConfig(index_type="IVF_PQ", index_min_rows=300, index_fold_rows=150, resident_index=False)
    assert 88 % cfg.index_sub_vectors
    first = _sim_width_fleet(0, 10)
    encoder = NormalizedStateEncoder(8).fit(np.concatenate([episode_windows(e, 8, 4)[1] for e in first]))
    assert encoder.dim == 88
    store = SegmentStore.open(tmp_path / "segments", cfg, encoder.dim)
    indexed_at, unindexed = [], []
    for batch in range(12):  # 10 episodes x 7 windows a batch: crosses 300 rows at batch 5
        episodes = first if batch == 0 else _sim_width_fleet(batch, 10)
        report = store.upsert(episodes, encoder, snapshot=f"snap-{batch}")
        assert report.inserted == report.segments == 70
        if store.ensure_index():
            indexed_at.append(store.count())
            name = store._indexed_columns()["vector"]
            unindexed.append(store._table.index_stats(name).num_unindexed_rows)
        probe = encoder.encode(episode_windows(episodes[-1], 8, 4)[1][:1])
        assert store.search(probe, k=1).episode_ids[0, 0] == episodes[-1].episode_id
    assert store.count() == 12 * 70 and indexed_at[0] == 5 * 70 and len(indexed_at) == 8
    assert store.index_plan().sub_vectors == 22 and store.index_plan().derived
    assert max(unindexed) < cfg.index_fold_rows  # ingest folds new rows into the index as it grows
    hit = store.search(encoder.encode(episode_windows(first[3], 8, 4)[1]), k=3, success=False)
    assert (~hit.success).all() and hit.counts.tolist() == [3] * len(hit)


def test_upkeep_compacts_prunes_and_keeps_tagged_versions(tmp_path: Path) -> None:
    # IVF_PQ (the default) on purpose: on a table this small an HNSW index (graphs + SQ codes)
    # outweighs the versions pruned, and bytes are what this test checks
    cfg = CFG.model_copy(update={"retain_versions_days": 0, "index_min_rows": 256, "index_type": "IVF_PQ"})
    episodes = make_fleet(count=60)
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", cfg, encoder.dim)
    for i in range(0, 60, 6):  # ten small upserts: ten versions, small fragments
        store.upsert(episodes[i : i + 6], encoder, snapshot=f"snap-{i}")
    rows = sorted_rows(store)
    report = store.upkeep()
    assert report.index_built and store.has_index()
    assert report.fragments_before > report.fragments_after == 1
    assert report.versions_before > report.versions_after and report.bytes_after < report.bytes_before
    assert sorted_rows(store).equals(rows)  # compaction moves rows, never changes them

    # a tagged version survives upkeep and still reads back (lineage points at it)
    tagged = store.tag("run-1")
    store.upsert(make_fleet(seed=3, count=6), encoder, snapshot="snap-late")
    again = store.upkeep()
    assert again.tags == {"run-1": tagged} and not again.index_rebuilt
    assert store.checkout("run-1").count() == rows.num_rows
    # the table doubled since the index was built: upkeep retrains it for today's size
    store.upsert(make_fleet(seed=4, count=60), encoder, snapshot="snap-grow")
    assert store.upkeep().index_rebuilt
    store.untag("run-1")
    assert store.tags() == {}


def _reference_nearest(vectors: np.ndarray, queries: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Brute force in float64: (Q, k) row positions (ties by row order) and distances."""
    v, q = vectors.astype(np.float64), queries.astype(np.float64)
    if metric == "cosine":
        v, q = v / np.linalg.norm(v, axis=1, keepdims=True), q / np.linalg.norm(q, axis=1, keepdims=True)
        d = 1.0 - q @ v.T
    else:
        d = ((q[:, None, :] - v[None, :, :]) ** 2).sum(-1)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(d, order, axis=1)


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_many_queries_scan_the_table_once_exactly_whatever_the_batch_sizes(tmp_path: Path, metric: str) -> None:
    """A large batch of queries (FERT's) is answered exactly by one streaming pass: the same
    neighbours as float64 brute force on the filtered rows, and bit-identical across scan batch
    sizes, query blocks, and the exact flag."""
    episodes = make_fleet(count=60)
    encoder = fit_encoder(episodes)
    cfg = CFG.model_copy(update={"metric": metric, "scan_min_queries": 8, "index_min_rows": 100_000})
    store = SegmentStore.open(tmp_path / "segments", cfg, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    rows = store._table.search().select(["vector", "segment_id", "success", "task"]).limit(None).to_arrow()
    keep = np.asarray(rows.column("success").to_pylist()) & (np.asarray(rows.column("task").to_pylist()) == "push")
    vectors = np.stack(rows.column("vector").to_pylist()).astype(np.float32)[keep]
    ids = np.asarray(rows.column("segment_id").to_pylist(), dtype=object)[keep]
    queries = encoder.encode(np.concatenate([cut_windows(ep.states, 8, 4).windows for ep in episodes[:6]]))
    queries += np.random.default_rng(3).normal(0, 0.05, queries.shape).astype(np.float32)  # not exact copies
    assert len(queries) >= cfg.scan_min_queries

    got = store.search(queries, k=7, success=True, task="push")
    order, distances = _reference_nearest(vectors, queries, 7, metric)
    assert (got.segment_ids == ids[order]).all() and got.counts.tolist() == [7] * len(queries)
    np.testing.assert_allclose(got.distances, distances, rtol=1e-4, atol=1e-5)
    assert got.success.all()

    for update in ({"scan_rows": 5}, {"scan_query_block": 3}, {"scan_rows": 7, "scan_query_block": 1}):
        other = SegmentStore.open(tmp_path / "segments", cfg.model_copy(update=update), encoder.dim)
        again = other.search(queries, k=7, success=True, task="push")
        assert (again.segment_ids == got.segment_ids).all(), update
        np.testing.assert_array_equal(again.distances, got.distances)
    one = store.search(queries[:1], k=7, success=True, task="push", exact=True)  # below the threshold, exact
    assert (one.segment_ids[0] == got.segment_ids[0]).all()

    few = store.search(queries, k=len(vectors) + 5, success=True, task="push")  # k beyond the filtered rows
    assert few.counts.tolist() == [len(vectors)] * len(queries) and (few.starts[:, len(vectors):] == -1).all()


# ---------------------------------------------------------------------- index types


def test_ivf_hnsw_sq_is_built_searched_folded_and_kept_by_upkeep(tmp_path: Path) -> None:
    cfg = CFG.model_copy(update={"index_type": "IVF_HNSW_SQ", "index_min_rows": 1000, "hnsw_partition_rows": 600,
                                 "index_fold_rows": 50, "retain_versions_days": 0})
    episodes = make_fleet(count=320)
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", cfg, encoder.dim)
    store.upsert(episodes[:300], encoder, snapshot="snap-a")
    assert store.ensure_index() and store.index_type() == "IVF_HNSW_SQ"
    assert store.index_plan().partitions == -(-store.count() // 600) > 1
    # held-out queries (episodes not in the table), fewer than scan_min_queries: LanceDB's index answers
    probe = np.concatenate([cut_windows(e.states, 8, 4).windows for e in make_fleet(seed=9, count=8)])[:40]
    queries = encoder.encode(probe)
    assert len(queries) < cfg.scan_min_queries
    for success in (None, True):
        ann = store.search(queries, k=10, success=success)
        exact = store.search(queries, k=10, success=success, exact=True)
        assert _recall(ann.segment_ids, exact.segment_ids) >= 0.9
        assert success is None or ann.success.all()
    # ingest folds new rows into the graph index once index_fold_rows are unindexed
    store.upsert(episodes[300:], encoder, snapshot="snap-b")
    assert store.ensure_index()
    name = store._indexed_columns()["vector"]
    assert store._table.index_stats(name).num_unindexed_rows == 0
    probe = encoder.encode(cut_windows(episodes[-1].states, 8, 4).windows[:1])
    assert store.search(probe, k=1).episode_ids[0, 0] == episodes[-1].episode_id
    # upkeep keeps the type (no growth, no retrain) and the index still answers
    report = store.upkeep()
    assert not report.index_rebuilt and store.index_type() == "IVF_HNSW_SQ"
    assert store.search(probe, k=1).episode_ids[0, 0] == episodes[-1].episode_id


def test_store_indexed_with_the_old_type_keeps_working_until_upkeep_rebuilds_it(tmp_path: Path) -> None:
    old = CFG.model_copy(update={"index_type": "IVF_PQ", "index_min_rows": 256})
    episodes = make_fleet(count=60)
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", old, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    assert store.ensure_index() and store.index_type() == "IVF_PQ"

    new = SegmentStore.open(tmp_path / "segments", old.model_copy(update={"index_type": "IVF_HNSW_SQ"}), encoder.dim)
    version = new.version
    assert new.ensure_index() and new.version == version  # the ingest path does not rebuild inline
    queries = encoder.encode(cut_windows(episodes[0].states, 8, 4).windows)
    # searched with IVF_PQ's keys (refine re-ranks exactly): the top hit is brute force's
    hits, brute = new.search(queries, k=5), new.search(queries, k=5, exact=True)
    np.testing.assert_allclose(hits.distances[:, 0], brute.distances[:, 0], rtol=1e-5)
    report = new.upkeep()
    assert report.index_rebuilt and new.index_type() == "IVF_HNSW_SQ"
    assert not new.upkeep().index_rebuilt  # rebuilt once, then kept
    assert (new.search(queries, k=1).episode_ids[:, 0] == episodes[0].episode_id).all()
