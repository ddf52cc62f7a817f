"""The ingest path (components/pipeline/ingest.py) as the dataset grows: new episodes are found
from the store's embed cursor, never by reading what is already stored; crash-safe and idempotent.

Real Parquet dataset and LanceDB store in tmp_path; no mocks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from components.config import Settings
from components.episodes.record import Episode, new_episode_id
from components.episodes.schema import write_episode_file
from components.pipeline.ingest import (
    PhaseTimes,
    embed,
    episodes_to_embed,
    ingest_files,
    read_file,
    store_episodes,
    upkeep_store,
    upsert,
)
from components.pipeline.workspace import Workspace
from components.store.segment_store import EMBED_CURSOR_KEY, VECTOR, EmbedCursor


def episode_files(settings: Settings, folder: Path, seed: int, count: int, frames: int = 24) -> list[Path]:
    """``count`` episode files with the simulator's state/action widths (11 and 3 here)."""
    ws = Workspace(settings)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        episode = Episode(
            episode_id=new_episode_id(rng),
            robot_id=f"robot-{i % 2:04d}",
            task="pick-place",
            states=np.cumsum(rng.standard_normal((frames, ws.obs_dim)), axis=0).astype(np.float32),
            actions=rng.uniform(-1, 1, (frames, ws.act_dim)).astype(np.float32),
            timestamps=np.arange(frames, dtype=np.float32) / settings.episodes.fps,
            success=i % 3 != 0,
        )
        paths.append(write_episode_file(episode, folder / f"{seed}-{i}.parquet"))
    return paths


def stored_ids(settings: Settings) -> list[str]:
    return Workspace(settings).dataset.episode_ids()


def test_each_ingest_embeds_only_its_batch_and_moves_the_cursor(settings, tmp_path):
    first = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=5), snapshot=False)
    ids = stored_ids(settings)
    assert first.segments_upserted > 0
    assert Workspace(settings).store.embed_cursor() == EmbedCursor(5, ids[-1], rows=first.segments_upserted)

    # the first batch's data file is gone while the second ingests: had ingest read stored
    # episodes (the old scan), it would fail here
    data_file = Workspace(settings).dataset.data_files()[0]
    aside = tmp_path / "aside.parquet"
    shutil.move(data_file, aside)
    try:
        second = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=2, count=4), snapshot=False)
    finally:
        shutil.move(aside, data_file)
    ws = Workspace(settings)
    ids = stored_ids(settings)
    assert len(second.report.added) == 4 and len(ids) == 9
    assert ws.store.episode_ids() == set(ids)
    assert ws.store.embed_cursor() == EmbedCursor(9, ids[-1], rows=ws.store.count())

    # re-ingesting the same files: nothing stored, nothing embedded, the table version stays
    version = ws.store.version
    again = ingest_files(settings, sorted((tmp_path / "in").glob("2-*.parquet")), snapshot=False)
    assert not again.report.added and again.segments_upserted == 0 and again.store_version == version


def test_an_ingest_reports_each_of_its_phases(settings, tmp_path):
    times = PhaseTimes()
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=3), times=times)
    assert list(times) == ["sync", "read", "store", "snapshot", "plan", "embed", "upsert", "index"]
    assert all(seconds >= 0 for seconds in times.values())
    once = dict(times)
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=2, count=3), times=times)
    assert all(times[name] >= once[name] for name in once)  # a second batch adds to the same phases


def test_an_ingest_that_died_before_embedding_is_completed_by_the_next(settings, tmp_path):
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=3), snapshot=False)
    # the next ingest stores its episodes, then dies before embedding them
    crashed = episode_files(settings, tmp_path / "in", seed=2, count=3)
    report = store_episodes(settings, [read_file(settings, f) for f in crashed])
    assert len(report.added) == 3 and len(episodes_to_embed(settings)) == 3
    assert Workspace(settings).store.embed_cursor().episodes == 3

    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=3, count=2), snapshot=False)
    ws = Workspace(settings)
    ids = stored_ids(settings)
    assert ws.store.episode_ids() == set(ids) and len(ids) == 8
    assert ws.store.embed_cursor() == EmbedCursor(8, ids[-1], rows=ws.store.count())
    assert episodes_to_embed(settings) == []


def test_upserts_skip_the_lookup_only_while_the_cursors_row_count_holds(settings, tmp_path):
    """Appending a batch without looking its rows up is safe only while the table has the rows
    the cursor counted. A write the cursor did not see (an ingest that died between its upsert and
    its cursor, here) makes the next upsert look its rows up: nothing is stored twice."""
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=3), snapshot=False)
    ws = Workspace(settings)
    encoder = ws.store.load_encoder()
    assert ws.store.embed_cursor().rows == ws.store.count() > 0

    def store_and_embed(seed: int) -> list[Episode]:
        files = episode_files(settings, tmp_path / "in", seed=seed, count=3)
        store_episodes(settings, [read_file(settings, f) for f in files])
        return episodes_to_embed(settings)

    # an ordinary ingest: the chain holds, the batch is appended without a lookup
    appended = upsert(settings, [embed(settings, store_and_embed(2), encoder, "")], encoder)
    assert not appended.looked_up and appended.inserted == appended.segments > 0
    assert Workspace(settings).store.embed_cursor().rows == appended.rows_after == Workspace(settings).store.count()

    # the next ingest upserts its episodes, then dies before moving the cursor
    store = Workspace(settings).store
    died = store.upsert_rows(embed(settings, store_and_embed(3), encoder, ""), encoder)
    assert died.inserted > 0 and store.embed_cursor().rows == died.rows_before < died.rows_after

    # the next one sees a table the cursor did not count: it looks its rows up, stores none twice
    redone = upsert(settings, [embed(settings, episodes_to_embed(settings), encoder, "")], encoder)
    assert redone.looked_up and redone.inserted == 0 and redone.unchanged == redone.segments > 0
    ws = Workspace(settings)
    segment_ids = ws.store._table.search().select(["segment_id"]).limit(None).to_arrow().column("segment_id")
    assert len(segment_ids) == len(set(segment_ids.to_pylist())) == ws.store.count()
    ids = stored_ids(settings)
    assert ws.store.episode_ids() == set(ids) and len(ids) == 9
    # the extra rows were all the batch's own (the lookup's hits): the chain holds again
    assert ws.store.embed_cursor() == EmbedCursor(9, ids[-1], rows=ws.store.count())

    # a writer the cursor does not know (rows of an episode no ingest stored) breaks the chain
    rng = np.random.default_rng(5)
    states = np.cumsum(rng.standard_normal((24, ws.obs_dim)), axis=0).astype(np.float32)
    stranger = Episode(
        episode_id=new_episode_id(rng), robot_id="robot-0099", task="pick-place", states=states,
        actions=np.zeros((24, ws.act_dim), np.float32), timestamps=np.arange(24, dtype=np.float32) / 10, success=True,
    )
    ws.store.upsert([stranger], encoder, snapshot="")
    after = upsert(settings, [embed(settings, store_and_embed(6), encoder, "")], encoder)
    assert after.looked_up and after.inserted == after.segments > 0
    assert Workspace(settings).store.embed_cursor().rows == -1
    # upkeep's recount cannot restore it while the stranger's rows are there (no dataset episode)
    upkeep_store(settings)
    assert Workspace(settings).store.embed_cursor().rows == -1


def test_a_store_without_a_cursor_is_caught_up_once(settings, tmp_path):
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=4), snapshot=False)
    # a store written before cursors existed: the same segments, no cursor
    ws = Workspace(settings)
    encoder, old = ws.store.load_encoder(), list(ws.dataset.episodes())
    shutil.rmtree(settings.paths.store)
    legacy = Workspace(settings).store
    legacy.upsert(old, encoder, snapshot="")
    assert legacy.embed_cursor() is None and legacy.episode_ids() == set(stored_ids(settings))
    # the next ingest compares the dataset with the store once, embeds what it lacks, records the cursor
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=2, count=2), snapshot=False)
    ws = Workspace(settings)
    ids = stored_ids(settings)
    assert ws.store.episode_ids() == set(ids) and len(ids) == 6
    # the store held rows before any cursor: no row count is trusted, upserts look rows up ...
    assert ws.store.embed_cursor() == EmbedCursor(6, ids[-1], rows=-1)
    # ... until upkeep finds every stored segment is the dataset's and recounts
    upkeep_store(settings)
    assert Workspace(settings).store.embed_cursor() == EmbedCursor(6, ids[-1], rows=ws.store.count())
    appended = upsert(settings, [embed(settings, ws.dataset.episodes(start=4), ws.store.load_encoder(), "")], ws.store.load_encoder())
    assert appended.looked_up  # episodes before the cursor are never appended blind


def test_cursors_of_older_and_newer_versions_are_read(settings, tmp_path):
    """A cursor from before ``rows`` existed reads as rows=-1 (look up); fields a newer version
    adds are skipped, so hosts on mixed versions keep ingesting."""
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=3), snapshot=False)
    store = Workspace(settings).store
    cursor = store.embed_cursor()
    for blob, expected in (
        ({"episodes": cursor.episodes, "last_episode_id": cursor.last_episode_id}, dataclasses.replace(cursor, rows=-1)),
        ({**dataclasses.asdict(cursor), "from_a_newer_version": [1, 2]}, cursor),
    ):
        store._table.update_field_metadata({"path": VECTOR, "metadata": {EMBED_CURSOR_KEY: json.dumps(blob)}})
        assert Workspace(settings).store.embed_cursor() == expected


def test_a_cursor_from_another_dataset_is_not_trusted(settings, tmp_path):
    ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=4), snapshot=False)
    # the dataset is replaced by another one (same size); the store and its cursor stay
    shutil.rmtree(settings.paths.episodes)
    ingest_files(settings, episode_files(settings, tmp_path / "other", seed=9, count=4), snapshot=False)
    ws = Workspace(settings)
    ids = stored_ids(settings)
    assert set(ids) <= ws.store.episode_ids()  # every episode of the new dataset was embedded
    assert ws.store.embed_cursor() == EmbedCursor(4, ids[-1], rows=-1)  # the old rows stay


def test_dvc_never_walks_the_store_and_a_users_dvcignore_keeps_its_lines(settings, tmp_path):
    """`dvc add` indexes the whole root first: the store (thousands of LanceDB files at fleet
    scale), the spool, quarantine and MLflow's runs are ignored, so a snapshot's cost does not
    grow with them; lines a user wrote stay, ours are added once."""
    from dvc.repo import Repo

    from components.episodes.snapshot import DVCIGNORE_LINES, ensure_dvc_repo

    root = settings.root
    root.mkdir(parents=True, exist_ok=True)
    (root / ".dvcignore").write_text("*.tmp-of-mine")  # a user's line, no trailing newline
    result = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=5, count=3))
    assert result.snapshot is not None and result.segments_upserted > 0
    lines = (root / ".dvcignore").read_text().splitlines()
    assert lines[0] == "*.tmp-of-mine" and [line for line in lines if line in DVCIGNORE_LINES] == list(DVCIGNORE_LINES)
    ensure_dvc_repo(root)
    assert (root / ".dvcignore").read_text().splitlines() == lines  # idempotent
    with Repo(str(root)) as repo:
        superseded = settings.paths.episodes / ".superseded"  # data files a merge replaced (data_files.py)
        for folder in (settings.paths.store, settings.paths.incoming, settings.paths.quarantine, settings.paths.mlruns,
                       superseded):
            assert repo.dvcignore.is_ignored_dir(str(folder)), folder
        assert not repo.dvcignore.is_ignored_dir(str(settings.paths.episodes))


def test_a_dvc_lock_file_left_truncated_by_a_killed_writer_does_not_stop_snapshots(settings, tmp_path):
    """DVC rewrites .dvc/tmp/rwlock in place; a SIGKILL during the rewrite (tests/test_ingest_kills.py
    found it) left it truncated and every later `dvc add` failed. A well-formed file naming a dead
    process is DVC's to clear, and is left alone."""
    from components.episodes.snapshot import repair_dvc_rwlock

    first = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=2))
    rwlock = settings.root / ".dvc" / "tmp" / "rwlock"
    rwlock.parent.mkdir(parents=True, exist_ok=True)
    dead = {"write": {str(settings.paths.episodes): {"pid": 2**22 + 1, "cmd": "killed ingest"}}}
    rwlock.write_text(json.dumps(dead))
    assert not repair_dvc_rwlock(settings.root) and json.loads(rwlock.read_text()) == dead
    second = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=2, count=2))

    rwlock.write_text(json.dumps(dead)[:17])  # what a writer killed mid-rewrite leaves
    third = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=3, count=2))
    snapshots = [r.snapshot.hash for r in (first, second, third)]
    assert len(set(snapshots)) == 3 and len(third.report.added) == 2
    assert Workspace(settings).dataset.num_episodes == 6


def test_a_snapshot_record_torn_by_a_killed_dvc_add_is_written_again(settings, tmp_path):
    """DVC writes ``episodes.dvc`` in place; a SIGKILL during ``dvc add`` left it empty and every
    later ingest failed reading it (tests/test_ingest_kills.py found it). The next ingest writes it
    again, with the hash DVC gives the intact data."""
    from components.episodes.snapshot import read_snapshot, torn_record

    dvc_file = settings.paths.episodes.with_name(settings.paths.episodes.name + ".dvc")
    first = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=2))
    whole = dvc_file.read_text()
    cut_in_hash = whole[: whole.index(".dir") - 3]
    for torn in ("", whole[: len(whole) // 2], whole[: whole.rindex("episodes") + 4], cut_in_hash, "outs:\n- path: episodes\n"):
        dvc_file.write_text(torn)
        assert torn_record(settings.paths.episodes) and read_snapshot(settings.paths.episodes) is None
        again = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=1, count=2))
        assert not again.report.added and again.snapshot.hash == first.snapshot.hash
        assert read_snapshot(settings.paths.episodes).hash == first.snapshot.hash
    second = ingest_files(settings, episode_files(settings, tmp_path / "in", seed=2, count=2))
    assert second.snapshot.hash != first.snapshot.hash and Workspace(settings).dataset.num_episodes == 4


def test_the_growth_fit_finds_a_known_slope_and_leaves_index_builds_out():
    """benchmarks/ingest.py's growth line: batch times that gain 5 ms per million stored frames
    under +-30% host noise, with fold spikes, give back about 5 ms, an interval holding it, and
    the spikes and the first batch outside the fit."""
    from benchmarks.ingest import growth_fit

    rng = np.random.default_rng(0)
    stored = np.arange(1, 1001) * 10_000
    seconds = (0.3 + 0.005 * stored / 1e6) * rng.uniform(0.7, 1.3, stored.size)
    seconds[0], seconds[20::21] = 2.5, 6.0  # DVC init; a fold every 21 batches
    fit = growth_fit([{"stored_frames": int(f), "seconds": float(s)} for f, s in zip(stored, seconds)])
    low, high = fit["slope_95"]
    assert low < 5.0 < high and abs(fit["slope_ms_per_million_frames"] - 5.0) < 1.5
    assert fit["batches_left_out"] == seconds[20::21].size and fit["batches_fitted"] == 999 - seconds[20::21].size
    assert abs(fit["fitted_last_over_first"] - (0.3 + 0.05) / (0.3 + 0.00002)) < 0.06  # 1.5 ms/M of slope
