"""The resident index (components/store/resident.py) answers single queries like LanceDB's flat
search: same rows, same distances, same filters, same padding; IVF keeps recall, follows the
table's version, and steps aside above ``store.resident_max_rows``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from components.config import StoreConfig
from components.store import SegmentStore, cut_windows, episode_windows
from tests.test_store import _recall, fit_encoder, make_fleet

CFG = StoreConfig(window=8, stride=4, index_min_rows=256, upsert_batch_rows=200, resident_list_rows=60,
                  resident_nprobe=2)


def _queries(store_episodes, encoder, n: int = 3) -> np.ndarray:
    failed = [e for e in store_episodes if not e.success][:n]
    return encoder.encode(np.concatenate([episode_windows(e, 8, 4)[1] for e in failed]))


def _same(got, want, rtol: float = 1e-4) -> None:
    """Same hits (ids in rank order, padding included) and the same distances."""
    assert (got.counts == want.counts).all()
    assert (got.segment_ids == want.segment_ids).all() and (got.episode_ids == want.episode_ids).all()
    assert (got.robot_ids == want.robot_ids).all() and (got.success == want.success).all()
    assert (got.starts == want.starts).all() and (got.ends == want.ends).all()
    np.testing.assert_allclose(got.distances, want.distances, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_a_small_table_is_answered_exactly_with_every_filter(tmp_path: Path, metric: str) -> None:
    episodes = make_fleet(count=30)
    encoder = fit_encoder(episodes)
    cfg = CFG.model_copy(update={"metric": metric, "index_min_rows": 10_000})
    store = SegmentStore.open(tmp_path / "segments", cfg, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    queries = _queries(episodes, encoder)
    excluded = [e.episode_id for e in episodes[:20]]
    cases = [{}, {"success": True}, {"success": False}, {"task": "push", "robot_id": "robot-0002"},
             {"exclude_episode_ids": excluded}, {"task": "no-such-task"}, {"robot_id": "robot-0001", "success": True}]
    for filters in cases:
        for k in (1, 10, 500):  # 500: more than any filter keeps, so the padding is compared too
            got = store.search(queries, k=k, **filters)
            assert store.resident().kind == "flat" and got.version == store.version
            _same(got, store.search(queries, k=k, exact=True, **filters))
    assert store.search(queries, k=5, task="no-such-task").counts.tolist() == [0] * len(queries)


def test_ivf_keeps_recall_widens_its_probe_for_narrow_filters_and_follows_the_version(tmp_path: Path) -> None:
    episodes = make_fleet(count=120)
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    resident = store.resident()
    assert resident.kind == "ivf" and resident.index.nlist == store.count() // CFG.resident_list_rows > 4
    queries = _queries(episodes, encoder, n=6)
    got = store.search(queries, k=10, success=True)
    truth = store.search(queries, k=10, success=True, exact=True)
    assert got.success.all() and _recall(got.segment_ids, truth.segment_ids) >= 0.9
    # one robot of four and one task of two keep 1/8 of the rows: the probe widens to every list
    # (2 lists x 8 > nlist), an exact filtered scan
    _same(store.search(queries, k=10, robot_id="robot-0001", task="pick-place"),
          store.search(queries, k=10, robot_id="robot-0001", task="pick-place", exact=True))

    before = store.version
    extra = make_fleet(seed=7, count=2)
    store.upsert(extra, encoder, snapshot="snap-b")
    probe = encoder.encode(cut_windows(extra[0].states, 8, 4).windows[:1])
    hit = store.search(probe, k=1)
    assert hit.episode_ids[0, 0] == extra[0].episode_id and hit.version == store.version > before
    assert store.resident() is not resident and store.resident().version == store.version
    # a read-only view of the older version is answered from that version
    old = store.checkout(before).search(probe, k=1)
    assert old.version == before and old.episode_ids[0, 0] != extra[0].episode_id


def test_the_same_table_builds_the_same_index(tmp_path: Path) -> None:
    episodes = make_fleet(count=120)
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    queries = _queries(episodes, encoder, n=6)
    first = store.search(queries, k=10, success=True)
    again = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim).search(queries, k=10, success=True)
    _same(again, first, rtol=0)


def test_above_resident_max_rows_or_switched_off_lancedb_answers(tmp_path: Path) -> None:
    episodes = make_fleet(count=40)
    encoder = fit_encoder(episodes)
    store = SegmentStore.open(tmp_path / "segments", CFG.model_copy(update={"index_min_rows": 10_000}), encoder.dim)
    store.upsert(episodes, encoder, snapshot="snap-a")
    queries = _queries(episodes, encoder)
    resident = store.search(queries, k=5, success=True)
    for update in ({"resident_max_rows": store.count() - 1}, {"resident_index": False}):
        other = SegmentStore.open(tmp_path / "segments", store.cfg.model_copy(update=update), encoder.dim)
        assert other.resident() is None
        _same(other.search(queries, k=5, success=True), resident)  # LanceDB flat: the same answer


def test_other_writers_reach_single_queries_within_resident_check_s(tmp_path: Path) -> None:
    episodes = make_fleet(count=30)
    encoder = fit_encoder(episodes)
    writer = SegmentStore.open(tmp_path / "segments", CFG, encoder.dim)
    writer.upsert(episodes, encoder, snapshot="snap-a")
    patient = SegmentStore.open(tmp_path / "segments", CFG.model_copy(update={"resident_check_s": 3600}), encoder.dim)
    eager = SegmentStore.open(tmp_path / "segments", CFG.model_copy(update={"resident_check_s": 0}), encoder.dim)
    extra = make_fleet(seed=9, count=1)
    probe = encoder.encode(cut_windows(extra[0].states, 8, 4).windows[:1])
    before = [reader.search(probe, k=1) for reader in (patient, eager)]
    writer.upsert(extra, encoder, snapshot="snap-b")
    stale, fresh = patient.search(probe, k=1), eager.search(probe, k=1)
    assert stale.version == before[0].version < writer.version and stale.episode_ids[0, 0] != extra[0].episode_id
    assert fresh.version == writer.version and fresh.episode_ids[0, 0] == extra[0].episode_id
    assert before[1].episode_ids[0, 0] != extra[0].episode_id


def test_an_empty_table_answers_padded_results(tmp_path: Path) -> None:
    store = SegmentStore.open(tmp_path / "segments", CFG, 32)
    got = store.search(np.zeros((2, 32), np.float32), k=3, success=True)
    assert got.counts.tolist() == [0, 0] and np.isinf(got.distances).all() and (got.segment_ids == "").all()
    assert got.version == store.version and len(store.resident()) == 0
