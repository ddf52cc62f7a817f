"""Episode data plane: schema, validation, quarantine and the LeRobot v3 dataset on disk."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from components.config import EpisodesConfig
from components.episodes.dataset import EpisodeDataset
from components.episodes.layout import EPISODES_META_PATH, INFO_PATH, STATS_PATH
from components.episodes.quarantine import quarantine_file, read_reason
from components.episodes.record import Episode, new_episode_id
from components.episodes.schema import (
    episode_schema,
    episode_to_ipc,
    episode_to_table,
    read_episode_bytes,
    table_to_episode,
    table_to_episodes,
    write_episode_file,
)
from components.episodes.validation import EpisodeValidationError, validate_episode_batch, validate_episode_table

STATE_DIM, ACTION_DIM = 4, 3
KNOWN = {"robot-0000", "robot-0001"}


def make_episode(rng: np.random.Generator, robot: str = "robot-0000", frames: int = 6, **kw) -> Episode:
    return Episode(
        episode_id=new_episode_id(rng),
        robot_id=robot,
        task="pick-place",
        states=rng.normal(size=(frames, STATE_DIM)).astype(np.float32),
        actions=rng.normal(size=(frames, ACTION_DIM)).astype(np.float32),
        timestamps=np.arange(frames, dtype=np.float32) / 10,
        success=bool(rng.integers(2)),
        **kw,
    )


def dataset_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.fixture
def ds(tmp_path: Path) -> EpisodeDataset:
    return EpisodeDataset(tmp_path / "episodes", EpisodesConfig())


# ----------------------------------------------------------------------------- schema


def test_episode_table_round_trip_keeps_values_and_extras(rng):
    ep = make_episode(rng, extras={"next.reward": np.arange(6, dtype=np.float32)})
    table = episode_to_table(ep)
    assert table.schema.field("observation.state").type == pa.list_(pa.float32(), STATE_DIM)
    assert table.select(episode_schema(STATE_DIM, ACTION_DIM).names).schema.equals(
        episode_schema(STATE_DIM, ACTION_DIM)
    )
    back = table_to_episode(table)
    assert back.episode_id == ep.episode_id and back.success == ep.success
    np.testing.assert_array_equal(back.states, ep.states)
    np.testing.assert_array_equal(back.actions, ep.actions)
    np.testing.assert_array_equal(back.extras["next.reward"], ep.extras["next.reward"])


def test_stored_episodes_keep_the_stage_they_reached(ds, tmp_path):
    """A simulated episode read back from the dataset reports the stage it reached (the max of its
    per-frame stage column); one without that column reports unknown (-1)."""
    from components.config import SimConfig
    from components.sim.collect import run_episodes
    from components.sim.expert import ScriptedExpert

    episodes = run_episodes(ScriptedExpert(), ["robot-0000", "robot-0001"], SimConfig(max_steps=6), 3, 0, "p")
    reached = {ep.episode_id: ep.stage_reached for ep in episodes}
    assert len(set(reached.values())) > 1  # the check can tell stages apart
    files = [write_episode_file(ep, tmp_path / f"{ep.episode_id}.parquet") for ep in episodes]
    plain = dataclasses.replace(episodes[0], episode_id=new_episode_id(np.random.default_rng(3)), extras={})
    files.append(write_episode_file(plain, tmp_path / "plain.parquet"))
    ds.ingest(files, KNOWN, tmp_path / "quarantine")
    back = {ep.episode_id: ep.stage_reached for ep in ds.episodes()}
    assert back == {**reached, plain.episode_id: -1}


def _same_episode(a: Episode, b: Episode) -> None:
    assert (a.episode_id, a.robot_id, a.task, a.success, a.interrupted, a.policy_version, a.stage_reached) == (
        b.episode_id, b.robot_id, b.task, b.success, b.interrupted, b.policy_version, b.stage_reached)
    for field in ("states", "actions", "timestamps"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    assert sorted(a.extras) == sorted(b.extras)
    for name in a.extras:
        x, y = a.extras[name], b.extras[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if x.dtype == object:
            assert [list(v) if isinstance(v, (list, np.ndarray)) else v for v in x] == [
                list(v) if isinstance(v, (list, np.ndarray)) else v for v in y], name
        else:
            np.testing.assert_array_equal(x, y)


def test_bulk_decoding_gives_each_slices_own_episode(rng):
    """table_to_episodes over episodes stored back to back equals table_to_episode on each one's
    slice, extras included: ones decoded once for the table (numbers, fixed-width vectors) and ones
    that must be decoded per episode (nulls where an episode lacks the column, strings, lists whose
    width differs between episodes)."""
    lengths = [5, 1, 9, 3]
    tables = []
    for i, frames in enumerate(lengths):
        extras = {"next.reward": rng.normal(size=frames).astype(np.float32),
                  "stage": np.full(frames, i, np.int64), "grip": rng.normal(size=(frames, 2)).astype(np.float32),
                  "note": np.array([f"e{i}f{t}" for t in range(frames)], dtype=object),
                  "ragged": rng.normal(size=(frames, 1 + i)).astype(np.float64)}
        if i == 2:
            del extras["next.reward"], extras["stage"]  # absent here: nulls in the stored table
        tables.append(episode_to_table(make_episode(rng, frames=frames, extras=extras)))
    table = pa.concat_tables(tables, promote_options="permissive")
    # "ragged" became a variable-size list: one width per episode, not one for the table
    assert not pa.types.is_fixed_size_list(table.schema.field("ragged").type)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    one_by_one = [table_to_episode(table.slice(a, b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
    bulk = table_to_episodes(table, lengths)
    assert len(bulk) == len(lengths)
    for a, b in zip(bulk, one_by_one):
        _same_episode(a, b)
    assert bulk[2].stage_reached == -1 and bulk[3].stage_reached == 3
    with pytest.raises(ValueError, match="sum to 17, the table has 18"):
        table_to_episodes(table, [5, 1, 9, 2])


def test_ipc_bytes_round_trip(rng):
    ep = make_episode(rng)
    table = read_episode_bytes(episode_to_ipc(ep))
    np.testing.assert_array_equal(table_to_episode(table).states, ep.states)
    with pytest.raises(ValueError, match="neither|nor"):
        read_episode_bytes(b"definitely not arrow")


def test_validation_error_is_one_clear_line(rng):
    table = episode_to_table(make_episode(rng)).drop_columns(["action"])
    with pytest.raises(EpisodeValidationError) as info:
        validate_episode_table(table, KNOWN, None, None, source="in/ep.parquet")
    err = info.value
    assert (err.source, err.field) == ("in/ep.parquet", "action")
    assert "\n" not in str(err) and "in/ep.parquet" in str(err) and "Fix:" in str(err)


# ----------------------------------------------------------------------------- bad inputs


def _replace(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, values)


def _vectors(values: np.ndarray, fixed: bool = True) -> pa.Array:
    if fixed:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.float32()), values.shape[1])
    return pa.array([list(row) for row in values], pa.list_(pa.float32()))


def _nan_in_action(t: pa.Table) -> pa.Table:
    a = np.stack(t.column("action").to_pylist()).astype(np.float32)
    a[2, 1] = np.nan
    return _replace(t, "action", _vectors(a))


def _inf_in_state(t: pa.Table) -> pa.Table:
    s = np.stack(t.column("observation.state").to_pylist()).astype(np.float32)
    s[4, 0] = np.inf
    return _replace(t, "observation.state", _vectors(s))


def _ragged_state(t: pa.Table) -> pa.Table:
    rows = [list(r) for r in t.column("observation.state").to_pylist()]
    rows[3] = rows[3][:-1]
    return _replace(t, "observation.state", pa.array(rows, pa.list_(pa.float32())))


def _wrong_state_width(t: pa.Table) -> pa.Table:
    s = np.zeros((t.num_rows, STATE_DIM + 1), np.float32)
    return _replace(t, "observation.state", _vectors(s))


def _state_float64(t: pa.Table) -> pa.Table:
    s = np.zeros((t.num_rows, STATE_DIM), np.float64)
    return _replace(t, "observation.state", pa.FixedSizeListArray.from_arrays(pa.array(s.reshape(-1)), STATE_DIM))


def _time_backwards(t: pa.Table) -> pa.Table:
    ts = t.column("timestamp").to_numpy().copy()
    ts[3] = ts[1]
    return _replace(t, "timestamp", pa.array(ts, pa.float32()))


def _frames_skip(t: pa.Table) -> pa.Table:
    fi = np.arange(t.num_rows, dtype=np.int64)
    fi[2:] += 1
    return _replace(t, "frame_index", pa.array(fi))


def _success_varies(t: pa.Table) -> pa.Table:
    return _replace(t, "success", pa.array([i % 2 == 0 for i in range(t.num_rows)]))


def _robot_varies(t: pa.Table) -> pa.Table:
    return _replace(t, "robot_id", pa.array(["robot-0000"] * (t.num_rows - 1) + ["robot-0001"]))


BAD_CASES: dict[str, tuple[Callable[[pa.Table], pa.Table], str]] = {
    "missing_column": (lambda t: t.drop_columns(["action"]), "action"),
    "timestamp_float64": (lambda t: _replace(t, "timestamp", t.column("timestamp").cast(pa.float64())), "timestamp"),
    "state_float64": (_state_float64, "observation.state"),
    "frame_index_int32": (lambda t: _replace(t, "frame_index", t.column("frame_index").cast(pa.int32())), "frame_index"),
    "state_width_differs_from_dataset": (_wrong_state_width, "observation.state"),
    "inconsistent_state_lengths": (_ragged_state, "observation.state"),
    "nan_in_action": (_nan_in_action, "action"),
    "inf_in_state": (_inf_in_state, "observation.state"),
    "timestamps_not_increasing": (_time_backwards, "timestamp"),
    "frame_index_not_0_to_T": (_frames_skip, "frame_index"),
    "success_not_constant": (_success_varies, "success"),
    "robot_id_not_constant": (_robot_varies, "robot_id"),
    "episode_id_not_uuid4": (lambda t: _replace(t, "episode_id", pa.array(["episode-7"] * t.num_rows)), "episode_id"),
    "unknown_robot": (lambda t: _replace(t, "robot_id", pa.array(["intruder-9"] * t.num_rows)), "robot_id"),
    "empty_episode": (lambda t: t.slice(0, 0), "<file>"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_file_is_quarantined_and_good_files_still_ingested(case, ds, rng, tmp_path):
    mutate, field = BAD_CASES[case]
    inbox, quarantine = tmp_path / "incoming", tmp_path / "quarantine"
    ds.ingest([write_episode_file(make_episode(rng), inbox / "first.parquet")], KNOWN, quarantine)  # fixes dims
    good = [write_episode_file(make_episode(rng, "robot-0001"), inbox / f"good{i}.parquet") for i in range(2)]
    bad = inbox / "bad.parquet"
    pq.write_table(mutate(episode_to_table(make_episode(rng))), bad)

    report = ds.ingest([good[0], bad, good[1]], KNOWN, quarantine)

    assert len(report.added) == 2 and ds.num_episodes == 3
    assert not bad.exists() and (quarantine / "bad.parquet").exists()
    reason = read_reason(quarantine / "bad.parquet")
    assert reason["field"] == field and reason["fix"] and reason["source"] == str(bad)
    assert [q.field for q in report.quarantined] == [field]


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_a_batch_with_one_bad_table_is_not_validated_together(case, rng):
    """validate_episode_batch never passes what validate_episode_table rejects: one bad table among
    good ones of any kind makes it decline (the dataset then validates them one by one)."""
    mutate, _ = BAD_CASES[case]
    good = [episode_to_table(make_episode(rng, "robot-0001", frames=4 + i)) for i in range(3)]
    bad = mutate(episode_to_table(make_episode(rng)))
    with pytest.raises(EpisodeValidationError):
        validate_episode_table(bad, KNOWN, STATE_DIM, ACTION_DIM, "bad")
    assert validate_episode_batch(good, KNOWN, STATE_DIM, ACTION_DIM) is not None
    assert validate_episode_batch([good[0], bad, *good[1:]], KNOWN, STATE_DIM, ACTION_DIM) is None


def test_batch_validation_stages_what_one_by_one_validation_stages(rng):
    """Validated together, a batch's episodes, canonical frames and content hashes are those of
    validating and canonicalising each table alone: variable-size vector lists, extra columns, and
    episodes whose first timestamp is below the previous episode's last (no step across them)."""
    from components.episodes.incoming import IncomingEpisode, stage_batch, stage_one

    tables = []
    for i, frames in enumerate((3, 7, 1, 5)):
        ep = make_episode(rng, f"robot-000{i % 2}", frames=frames, extras={"next.reward": np.arange(frames, dtype=np.float32)})
        t = episode_to_table(ep)
        states = pa.array(list(ep.states), pa.list_(pa.float32()))  # variable-size lists, as some writers send
        t = t.set_column(t.schema.get_field_index("observation.state"), "observation.state", states)
        tables.append(_replace(t, "timestamp", pa.array(np.arange(frames, dtype=np.float32) / 10 + 5 - i, pa.float32())))
    items = [IncomingEpisode(table=t, source=f"e{i}") for i, t in enumerate(tables)]
    batch = validate_episode_batch(tables, KNOWN, None, None)
    assert batch is not None
    together = stage_batch(items, batch)
    alone = [stage_one(item, validate_episode_table(item.table, KNOWN, None, None, item.source), item.table)
             for item in items]
    assert [s.content_hash for s in together] == [s.content_hash for s in alone]
    for a, b in zip(together, alone):
        assert a.table.equals(b.table) and a.table.schema.equals(b.table.schema)
        _same_episode(a.episode, b.episode)


def test_slice_fingerprints_in_one_pass_equal_each_slices_own():
    """table_fingerprints hashes each slice's bytes exactly as table_fingerprint does alone, for
    every kind of column: numbers, bools, strings, fixed and variable lists, nulls at the row or
    the value level in some slices only, and types that fall back to JSON (timestamps)."""
    from components.episodes.fingerprint import table_fingerprint, table_fingerprints

    rng = np.random.default_rng(5)
    n = 23
    values = rng.normal(size=(n, 3)).astype(np.float32)
    ragged = [list(rng.normal(size=1 + i % 4)) for i in range(n)]
    table = pa.table({
        "i": pa.array(np.arange(n, dtype=np.int64)),
        "f": pa.array(rng.normal(size=n).astype(np.float32)),
        "b": pa.array(rng.random(n) < 0.5),
        "s": pa.array([f"r{i % 3}" for i in range(n)]),
        "fixed": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3),
        "ragged": pa.array(ragged, pa.list_(pa.float64())),
        "null_rows": pa.array([None if i in (4, 17) else float(i) for i in range(n)], pa.float64()),
        "null_values": pa.array([[1.0, None] if i == 9 else [1.0, 2.0] for i in range(n)], pa.list_(pa.float64())),
        "null_lists": pa.array([None if i == 20 else [i] for i in range(n)], pa.list_(pa.int64())),
        "when": pa.array(np.arange(n).astype("datetime64[s]")),
    })
    bounds = np.array([0, 1, 5, 5 + 7, 18, n])
    chunked = pa.concat_tables([table.slice(0, 10), table.slice(10)])  # chunking must not matter
    alone = [table_fingerprint(table.slice(a, b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
    assert table_fingerprints(table, bounds) == alone == table_fingerprints(chunked, bounds)
    assert len(set(alone)) == len(alone)
    # the recipe itself is pinned: stored content hashes and the fleet's spool quote it
    assert table_fingerprint(table) == "c8bd7727abfa848d572462a3c92efb0b1f8367b621f431325ac8781a04236efb"
    assert alone[2] == "ad99d6ad33e9d0a84c054cac287a044531a76018a2a3132d7bff1f998b4faa20"  # rows 5..11


def test_unreadable_file_is_quarantined(ds, rng, tmp_path):
    bad = tmp_path / "incoming" / "garbage.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 but not really")
    good = write_episode_file(make_episode(rng), tmp_path / "incoming" / "good.parquet")
    report = ds.ingest([bad, good], KNOWN, tmp_path / "quarantine")
    assert len(report.added) == 1
    assert read_reason(tmp_path / "quarantine" / "garbage.parquet")["field"] == "<file>"


def test_a_parquet_file_with_damaged_pages_is_quarantined_not_raised(ds, rng, tmp_path):
    """Corrupt compressed pages make pyarrow raise OSError, not ArrowInvalid: still a quarantine."""
    good = write_episode_file(make_episode(rng), tmp_path / "incoming" / "good.parquet")
    data = bytearray(good.read_bytes())
    data[8:40] = bytes(32)  # zero part of the first page: its header and compressed bytes
    bad = tmp_path / "incoming" / "damaged.parquet"
    bad.write_bytes(bytes(data))
    report = ds.ingest([bad, write_episode_file(make_episode(rng), tmp_path / "incoming" / "next.parquet")],
                       KNOWN, tmp_path / "quarantine")
    assert len(report.added) == 1 and ds.num_episodes == 1
    assert read_reason(tmp_path / "quarantine" / "damaged.parquet")["field"] == "<file>"


def test_episode_stats_columns_are_each_episodes_own_and_null_where_it_lacks_the_feature(ds, rng, tmp_path):
    """The batch's stats are computed column-wise; each row must equal the statistics of that
    episode's frames alone, bit for bit, and an extra feature only some episodes carry is null
    for the others."""
    from components.episodes.stats import column_values, feature_stats, stats_column

    episodes = [make_episode(rng, frames=5 + 37 * i) for i in range(3)]  # past numpy's 8-wide pairwise blocks
    episodes[1] = dataclasses.replace(episodes[1], extras={"next.reward": np.linspace(0, 1, 42, dtype=np.float32)})
    files = [write_episode_file(ep, tmp_path / "in" / f"{i}.parquet") for i, ep in enumerate(episodes)]
    ds.ingest(files, KNOWN, tmp_path / "quarantine")
    meta = ds.episodes_meta()
    for i, ep in enumerate(episodes):
        own = feature_stats(column_values(episode_to_table(ep).column("observation.state")))
        for stat, value in own.items():
            assert meta.column(stats_column("observation.state", stat))[i].as_py() == value.tolist(), (i, stat)
    reward = meta.column(stats_column("next.reward", "mean")).to_pylist()
    assert reward[0] is None and reward[2] is None
    assert reward[1] == feature_stats(episodes[1].extras["next.reward"].astype(np.float64).reshape(-1, 1))["mean"].tolist()
    np.testing.assert_allclose(reward[1], [episodes[1].extras["next.reward"].astype(np.float64).mean()], rtol=1e-12)
    names = meta.column_names
    assert names.index(stats_column("observation.state", "min")) == names.index("content_hash") + 1


def test_span_stats_of_a_run_do_not_depend_on_its_neighbours():
    """Ingest computes every episode's stats in one pass over the batch: a run's figures must be
    those of the run alone (so re-storing an episode in another batch gives the same stats), and
    the statistics themselves numpy's."""
    from components.episodes.stats import span_stats

    rng = np.random.default_rng(3)
    lengths = np.array([1, 7, 9, 130, 2, 513, 64])
    values = rng.standard_normal((int(lengths.sum()), 11)) * 40.0 + 3.0
    batch = span_stats(values, lengths)
    for i, (start, length) in enumerate(zip(np.cumsum(lengths) - lengths, lengths)):
        run = values[start : start + length]
        alone = span_stats(run, np.array([length]))
        for stat in alone:
            assert np.array_equal(alone[stat][0], batch[stat][i]), (i, stat)
        assert np.array_equal(batch["min"][i], run.min(axis=0)) and np.array_equal(batch["max"][i], run.max(axis=0))
        np.testing.assert_allclose(batch["mean"][i], run.mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(batch["std"][i], run.std(axis=0), rtol=1e-12)
        assert batch["count"][i].tolist() == [length]


def test_quarantine_never_overwrites_an_earlier_file(tmp_path):
    err = EpisodeValidationError("x", "action", "NaN", "fix it")
    targets = []
    for i in range(3):
        src = tmp_path / f"in{i}" / "ep.parquet"
        src.parent.mkdir()
        src.write_bytes(f"payload {i}".encode())
        targets.append(quarantine_file(src, err, tmp_path / "q").path)
    assert [p.name for p in targets] == ["ep.parquet", "ep-1.parquet", "ep-2.parquet"]
    assert [p.read_bytes() for p in targets] == [b"payload 0", b"payload 1", b"payload 2"]
    assert all(read_reason(p)["field"] == "action" for p in targets)


# ----------------------------------------------------------------------------- idempotence, duplicates


def test_reingesting_same_files_changes_nothing(ds, rng, tmp_path):
    files = [write_episode_file(make_episode(rng), tmp_path / "in" / f"{i}.parquet") for i in range(4)]
    first = ds.ingest(files, KNOWN, tmp_path / "q")
    assert len(first.added) == 4 and first.frames_added == 24
    before_hash, before_files = ds.content_hash(), dataset_files(ds.root)

    second = ds.ingest(files, KNOWN, tmp_path / "q")

    assert second.added == () and sorted(second.duplicates) == sorted(first.added)
    assert second.data_file is None and not second.quarantined
    assert ds.content_hash() == before_hash
    assert dataset_files(ds.root) == before_files  # no new data file, meta byte-identical
    assert EpisodeDataset(ds.root, EpisodesConfig()).content_hash() == before_hash


def test_same_episode_id_with_different_content_is_rejected(ds, rng, tmp_path):
    ep = make_episode(rng)
    ds.ingest([write_episode_file(ep, tmp_path / "in" / "a.parquet")], KNOWN, tmp_path / "q")
    before = ds.content_hash()
    edited = Episode(**{**ep.__dict__, "success": not ep.success})
    path = write_episode_file(edited, tmp_path / "in" / "a2.parquet")

    report = ds.ingest([path], KNOWN, tmp_path / "q")

    assert report.added == () and [q.field for q in report.quarantined] == ["episode_id"]
    assert "different content" in read_reason(tmp_path / "q" / "a2.parquet")["reason"]
    assert ds.content_hash() == before and ds.num_episodes == 1


def test_same_id_twice_in_one_batch(ds, rng, tmp_path):
    ep = make_episode(rng)
    other = Episode(**{**ep.__dict__, "task": "stack"})
    files = [
        write_episode_file(ep, tmp_path / "in" / "a.parquet"),
        write_episode_file(ep, tmp_path / "in" / "a_copy.parquet"),
        write_episode_file(other, tmp_path / "in" / "a_edit.parquet"),
    ]
    report = ds.ingest(files, KNOWN, tmp_path / "q")
    assert report.added == (ep.episode_id,) and report.duplicates == (ep.episode_id,)
    assert [q.path.name for q in report.quarantined] == ["a_edit.parquet"]


# ----------------------------------------------------------------------------- accepted forms


def test_variable_size_lists_are_accepted_and_stored_fixed(ds, rng, tmp_path):
    ep = make_episode(rng)
    table = episode_to_table(ep)
    table = _replace(table, "observation.state", _vectors(ep.states, fixed=False))
    table = _replace(table, "action", _vectors(ep.actions, fixed=False))
    path = tmp_path / "in" / "var.parquet"
    path.parent.mkdir()
    pq.write_table(table, path)

    assert ds.ingest([path], KNOWN, tmp_path / "q").added == (ep.episode_id,)
    assert ds.frames().schema.field("observation.state").type == pa.list_(pa.float32(), STATE_DIM)
    np.testing.assert_array_equal(next(ds.episodes()).states, ep.states)
    # the same content written with fixed-size lists is the same episode: a duplicate
    again = ds.ingest([write_episode_file(ep, tmp_path / "in" / "fixed.parquet")], KNOWN, tmp_path / "q")
    assert again.duplicates == (ep.episode_id,)


def test_arrow_ipc_stream_files_are_accepted(ds, rng, tmp_path):
    ep = make_episode(rng)
    path = tmp_path / "in" / "upload.arrows"
    path.parent.mkdir()
    path.write_bytes(episode_to_ipc(ep))
    assert ds.ingest([path], KNOWN, tmp_path / "q").added == (ep.episode_id,)
    np.testing.assert_array_equal(next(ds.episodes()).actions, ep.actions)


def test_add_episodes_in_memory(ds, rng, tmp_path):
    eps = [make_episode(rng, r) for r in ("robot-0000", "robot-0001", "robot-0001")]
    report = ds.add_episodes(eps)
    assert report.added == tuple(e.episode_id for e in eps)
    assert ds.robots() == {"robot-0000": 1, "robot-0001": 2}

    bad = make_episode(rng)
    bad.states[0, 0] = np.nan
    with pytest.raises(EpisodeValidationError, match="observation.state"):
        ds.add_episodes([make_episode(rng), bad])
    assert ds.num_episodes == 3  # nothing of the failed batch stored

    report = ds.add_episodes([make_episode(rng), bad], quarantine_dir=tmp_path / "q")
    assert len(report.added) == 1 and report.quarantined[0].field == "observation.state"
    assert report.quarantined[0].path.exists()


# ----------------------------------------------------------------------------- layout and readers


def test_lerobot_v3_layout_and_readers(ds, rng, tmp_path):
    eps = [make_episode(rng, "robot-0000"), make_episode(rng, "robot-0001", frames=9)]
    ds.add_episodes(eps[:1])
    ds.add_episodes(eps[1:])
    root = ds.root
    info = json.loads((root / INFO_PATH).read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["chunks_size"] == 1000
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (2, 15, 1)
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["features"]["observation.state"] == {"dtype": "float32", "shape": [STATE_DIM], "names": None}
    assert info["features"]["success"]["dtype"] == "bool"
    assert (root / "data/chunk-000/file-000.parquet").exists() and (root / "data/chunk-000/file-001.parquet").exists()

    # the episodes table: one file per ingest, each holding only that ingest's episodes
    files = sorted(root.glob("meta/episodes/chunk-*/file-*.parquet"))
    assert [f.relative_to(root).as_posix() for f in files] == [EPISODES_META_PATH, "meta/episodes/chunk-000/file-001.parquet"]
    meta = pa.concat_tables([pq.read_table(f) for f in files])
    for column in ("episode_index", "tasks", "length", "data/chunk_index", "data/file_index",
                   "dataset_from_index", "dataset_to_index", "episode_id", "success"):
        assert column in meta.column_names
    assert meta.column("dataset_from_index").to_pylist() == [0, 6]
    assert meta.column("dataset_to_index").to_pylist() == [6, 15]
    assert meta.column("data/file_index").to_pylist() == [0, 1]
    assert meta.column("meta/episodes/file_index").to_pylist() == [0, 1]

    import pandas as pd  # LeRobot reads tasks.parquet with pandas: the task string is the index

    tasks = pd.read_parquet(root / "meta/tasks.parquet")
    assert list(tasks.index) == ["pick-place"] and list(tasks["task_index"]) == [0]

    states = np.concatenate([e.states for e in eps]).astype(np.float64)
    stats = json.loads((root / STATS_PATH).read_text())["observation.state"]
    np.testing.assert_allclose(stats["mean"], states.mean(0), rtol=1e-9)
    np.testing.assert_allclose(stats["std"], states.std(0), rtol=1e-9)
    np.testing.assert_allclose(stats["min"], states.min(0))
    assert stats["count"] == [15]

    frames = ds.frames()
    assert frames.num_rows == ds.num_frames == 15
    assert frames.column("index").to_pylist() == list(range(15))
    assert set(frames.column("task").to_pylist()) == {"pick-place"}
    back = list(ds.episodes())
    assert [e.episode_id for e in back] == [e.episode_id for e in eps]
    for got, want in zip(back, eps):
        np.testing.assert_array_equal(got.states, want.states)
        np.testing.assert_array_equal(got.actions, want.actions)
        assert (got.robot_id, got.success, got.task) == (want.robot_id, want.success, want.task)
    assert ds.episode_index().column("episode_id").to_pylist() == [e.episode_id for e in eps]


def test_data_files_are_chunked(tmp_path, rng):
    ds = EpisodeDataset(tmp_path / "episodes", EpisodesConfig(chunk_size=2))
    for _ in range(3):
        ds.add_episodes([make_episode(rng)])
    files = sorted(str(p.relative_to(ds.root)) for p in ds.root.glob("data/*/*.parquet"))
    assert files == ["data/chunk-000/file-000.parquet", "data/chunk-000/file-001.parquet",
                     "data/chunk-001/file-000.parquet"]
    assert len(list(ds.episodes())) == 3


def test_crash_before_commit_loses_nothing(ds, rng, tmp_path):
    """A crash after the new data file and info/stats were written, before the episodes table."""
    first, second = make_episode(rng), make_episode(rng)
    ds.add_episodes([first])
    hash_after_first = ds.content_hash()
    ds.add_episodes([second])
    (ds.root / "meta/episodes/chunk-000/file-001.parquet").unlink()  # the commit never happened

    reopened = EpisodeDataset(ds.root, EpisodesConfig())
    assert reopened.num_episodes == 1 and reopened.content_hash() == hash_after_first
    assert [e.episode_id for e in reopened.episodes()] == [first.episode_id]

    report = reopened.add_episodes([second])  # retry: the orphan data file is simply replaced
    assert report.added == (second.episode_id,)
    info = json.loads((ds.root / INFO_PATH).read_text())
    assert info["total_episodes"] == 2 and len(list(ds.root.glob("data/*/*.parquet"))) == 2
    assert [e.episode_id for e in EpisodeDataset(ds.root, EpisodesConfig()).episodes()] == [
        first.episode_id, second.episode_id
    ]


def _meta_files(root: Path) -> list[str]:
    return [f.relative_to(root).as_posix() for f in sorted(root.glob("meta/episodes/chunk-*/file-*.parquet"))]


def _without_locations(table: pa.Table) -> pa.Table:
    """Episodes-table rows without where they are stored (merges move episodes' rows and frames)."""
    return table.drop_columns(["meta/episodes/chunk_index", "meta/episodes/file_index", "data/chunk_index",
                               "data/file_index"])


def test_the_newest_small_episodes_table_files_are_merged_and_nothing_else_changes(tmp_path, rng):
    """One episodes-table file per ingest would make a first open read one file per ingest: the
    writer merges the newest small ones once there are meta_merge_files of them. The table, the
    episodes, their order and the content hash are those of a dataset that never merged; every
    row's location names the file that holds it; a new process reads the same."""
    from components.episodes import meta_files

    batches = [[make_episode(rng, frames=5 + i), make_episode(rng, "robot-0001")] for i in range(7)]
    plain = EpisodeDataset(tmp_path / "plain", EpisodesConfig(meta_merge_files=1000))
    merged = EpisodeDataset(tmp_path / "merged", EpisodesConfig(meta_merge_files=3))
    for batch in batches:
        plain.add_episodes(batch)
        merged.add_episodes(batch)
    assert len(_meta_files(plain.root)) == 7
    # every file is small here: ingest 3 merges files 0-2 into 3, ingest 5 merges 3-5 into 6, ingest 7 6-8 into 9
    assert _meta_files(merged.root) == ["meta/episodes/chunk-000/file-009.parquet"]
    meta_files._cache.clear()  # what a new process sees
    reopened = EpisodeDataset(merged.root, EpisodesConfig(meta_merge_files=3))
    for table in (merged.episodes_meta(), reopened.episodes_meta()):
        assert _without_locations(table).equals(_without_locations(plain.episodes_meta()))
        assert table.column("episode_index").to_pylist() == list(range(14))
    assert reopened.content_hash() == plain.content_hash()
    assert [e.episode_id for e in reopened.episodes()] == [e.episode_id for b in batches for e in b]
    for chunk, file, index in zip(*(reopened.episodes_meta().column(c).to_pylist() for c in
                                    ("meta/episodes/chunk_index", "meta/episodes/file_index", "episode_index"))):
        held = pq.read_table(reopened.root / f"meta/episodes/chunk-{chunk:03d}/file-{file:03d}.parquet")
        assert index in held.column("episode_index").to_pylist()
    for chunk, file, index in zip(*(reopened.episodes_meta().column(c).to_pylist() for c in
                                    ("data/chunk_index", "data/file_index", "episode_index"))):
        held = pq.read_table(reopened.root / f"data/chunk-{chunk:03d}/file-{file:03d}.parquet")
        assert index in held.column("episode_index").to_pylist()


def test_an_open_after_an_ingest_extends_the_last_union_and_reads_what_a_new_process_reads(tmp_path, rng):
    """The episodes table a process keeps: reused while the files are unchanged, extended by an
    ingest's new file, rebuilt after a merge, and always the table a new process would read."""
    from components.episodes import meta_files

    cfg = EpisodesConfig(meta_merge_files=3)
    ds = EpisodeDataset(tmp_path / "episodes", cfg)
    for i in range(7):  # merges at the 3rd, 5th and 7th ingest
        ds.add_episodes([make_episode(rng, frames=5 + i)])
        kept = meta_files.read_episodes_table(ds.root, "episode_index")
        assert meta_files.read_episodes_table(ds.root, "episode_index") is kept, "unchanged files: no rework"
        meta_files._cache.clear()  # what a new process sees
        fresh = meta_files.read_episodes_table(ds.root, "episode_index")
        assert kept.equals(fresh) and kept.column("episode_index").to_pylist() == list(range(i + 1))
    assert ds.num_frames == sum(5 + i for i in range(7))


def test_only_the_newest_run_of_small_files_is_merged():
    """A merge takes the trailing run of small files (so the merged file, numbered last, keeps the
    union in episode order) and only once the run is long enough; big files stay as they are."""
    from components.episodes.meta_files import MetaFile, tail_to_merge

    def files(*sizes: int) -> list[MetaFile]:
        return [MetaFile(0, i, Path(f"file-{i:03d}.parquet"), size, 0) for i, size in enumerate(sizes)]

    assert [m.file for m in tail_to_merge(files(9, 1, 1, 1), 3, 5)] == [1, 2, 3]
    assert tail_to_merge(files(1, 1, 9, 1, 1), 3, 5) == []  # the small files before the big one are not the tail
    assert [m.file for m in tail_to_merge(files(1, 1, 1, 1), 3, 5)] == [0, 1, 2, 3]
    assert tail_to_merge(files(9, 9), 2, 5) == []


def test_a_merge_that_dies_before_removing_its_files_loses_and_repeats_nothing(tmp_path, rng, monkeypatch):
    """Fault injection: the merge writes its file, then dies removing the merged ones. Readers see
    every episode once (the newest file's row); the next merge takes the leftovers along."""
    from components.episodes import meta_files

    cfg = EpisodesConfig(meta_merge_files=2)
    ds = EpisodeDataset(tmp_path / "episodes", cfg)
    ds.add_episodes([make_episode(rng)])
    real_unlink = Path.unlink

    def dies(self, *args, **kwargs):
        raise OSError("killed while removing merged files")

    monkeypatch.setattr(Path, "unlink", dies)
    with pytest.raises(OSError, match="killed"):
        ds.add_episodes([make_episode(rng)])
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert len(_meta_files(ds.root)) == 3  # files 0, 1 and their merge, 2
    meta_files._cache.clear()
    reopened = EpisodeDataset(ds.root, cfg)
    assert reopened.num_episodes == 2 and reopened.episodes_meta().column("episode_index").to_pylist() == [0, 1]
    reopened.add_episodes([make_episode(rng)])  # the next merge: leftovers, their merge and the new file
    assert _meta_files(ds.root) == ["meta/episodes/chunk-000/file-004.parquet"]
    meta_files._cache.clear()
    assert EpisodeDataset(ds.root, cfg).episodes_meta().column("episode_index").to_pylist() == [0, 1, 2]


def test_stale_info_is_repaired_on_next_write(ds, rng):
    ds.add_episodes([make_episode(rng)])
    info_path = ds.root / INFO_PATH
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "total_episodes": 99}))
    reopened = EpisodeDataset(ds.root, EpisodesConfig())
    assert reopened.info()["total_episodes"] == 1
    reopened.add_episodes([make_episode(rng)])
    assert json.loads(info_path.read_text())["total_episodes"] == 2
    shutil.rmtree(ds.root / "data")  # sanity: readers really read the data files
    with pytest.raises(FileNotFoundError):
        list(EpisodeDataset(ds.root, EpisodesConfig()).episodes())


def test_two_handles_share_one_dataset(ds, rng):
    other = EpisodeDataset(ds.root, EpisodesConfig())
    ds.add_episodes([make_episode(rng)])
    assert other.num_episodes == 0  # a snapshot view until refreshed
    other.refresh()
    assert other.num_episodes == 1 and other.content_hash() == ds.content_hash()
    other.add_episodes([make_episode(rng)])  # a writer always reloads under the lock first
    ds.refresh()
    assert ds.num_episodes == 2 and len(list(ds.episodes())) == 2


def test_dataset_stats_pool_per_episode_stats_and_skip_episodes_without_them():
    from components.episodes.stats import stats_from_episodes_meta

    rng = np.random.default_rng(0)
    frames = [rng.normal(size=(n, 2)) for n in (5, 9, 3)]
    columns = {f"stats/x/{k}": [] for k in ("min", "max", "mean", "std", "count")}
    for f in frames:
        for k, v in (("min", f.min(0)), ("max", f.max(0)), ("mean", f.mean(0)), ("std", f.std(0)), ("count", [len(f)])):
            columns[f"stats/x/{k}"].append(list(map(float, v)) if k != "count" else v)
    for name in columns:  # a fourth episode recorded before this feature existed
        columns[name].append(None)
    stats = stats_from_episodes_meta(pa.table(columns))["x"]
    everything = np.concatenate(frames)
    np.testing.assert_allclose(stats["mean"], everything.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats["std"], everything.std(0), rtol=1e-12)
    np.testing.assert_array_equal(stats["min"], everything.min(0))
    assert stats["count"] == [17]


def test_a_slice_of_the_stored_episodes_reads_only_that_slice(ds, rng):
    for batch in range(3):  # three data files
        ds.add_episodes([make_episode(rng, f"robot-000{k}") for k in range(3)])
    everything = [e.episode_id for e in ds.episodes()]
    assert len(everything) == 9
    assert [e.episode_id for e in ds.episodes(4)] == everything[4:]
    assert [e.episode_id for e in ds.episodes(2, 7)] == everything[2:7]
    assert list(ds.episodes(9)) == []
    (ds.root / "data" / "chunk-000" / "file-000.parquet").unlink()  # the first file is never opened
    assert [e.episode_id for e in ds.episodes(3)] == everything[3:]


def test_frames_after_a_cursor_stream_only_the_files_that_hold_them(ds, rng):
    for batch in range(3):  # three data files of 3 episodes
        ds.add_episodes([make_episode(rng, f"robot-000{k}") for k in range(3)])
    ids = ds.episode_ids()
    assert ids == [e.episode_id for e in ds.episodes()] and ds.episode_ids(7) == ids[7:]
    everything = ds.frames()
    assert everything.num_rows == ds.num_frames
    batches = list(ds.frame_batches(start=4))  # the cursor sits inside the second file
    assert [len(set(b.column("episode_index").to_pylist())) for b in batches] == [2, 3]
    tail = ds.frames(start=4)
    assert tail.column("episode_id").unique().to_pylist() == ids[4:]
    assert tail.equals(everything.slice(everything.num_rows - tail.num_rows))
    assert ds.frames(2, 3).column("episode_id").unique().to_pylist() == [ids[2]]
    assert ds.frames(start=9).num_rows == 0
    (ds.root / "data" / "chunk-000" / "file-000.parquet").unlink()  # before the cursor: never opened
    assert ds.frames(start=3).num_rows == tail.num_rows + everything.filter(
        pc.equal(everything.column("episode_id"), ids[3])).num_rows


def test_columns_and_whole_episodes_of_listed_episodes_read_only_their_files(ds, rng):
    """The training set's reader: the listed episodes' frames in the order listed, decoded as
    ``episodes()`` decodes them, from only the files that hold them."""
    for batch in range(3):  # three data files of 3 episodes
        ds.add_episodes([make_episode(rng, f"robot-000{k}", frames=4 + k) for k in range(3)])
    stored = list(ds.episodes())
    order = [7, 2, 5, 8]  # episode_index values, across files and out of order
    columns = ds.episode_columns(order, ("observation.state", "action"))
    np.testing.assert_array_equal(columns["observation.state"], np.concatenate([stored[i].states for i in order]))
    np.testing.assert_array_equal(columns["action"], np.concatenate([stored[i].actions for i in order]))
    assert columns["action"].dtype == np.float32
    whole = ds.load_episodes([5, 2])
    assert [e.episode_id for e in whole] == [stored[5].episode_id, stored[2].episode_id]
    np.testing.assert_array_equal(whole[0].timestamps, stored[5].timestamps)
    (ds.root / "data" / "chunk-000" / "file-000.parquet").unlink()  # episodes 0-2: not listed below
    assert len(ds.episode_columns([3, 6], ("action",))["action"]) == stored[3].length + stored[6].length
    with pytest.raises(KeyError, match="episode_index \\[42\\]"):
        ds.load_episodes([42])


def test_stats_json_is_pooled_per_ingest_and_recomputed_when_it_does_not_match(ds, rng):
    from components.episodes.stats import stats_from_episodes_meta

    def close(a: dict, b: dict) -> None:
        assert a.keys() == b.keys()
        for feature in a:
            for stat in a[feature]:
                np.testing.assert_allclose(a[feature][stat], b[feature][stat], rtol=1e-9, atol=1e-12)

    for batch in range(3):
        ds.add_episodes([make_episode(rng, f"robot-000{k}", frames=5 + batch + k) for k in range(2)])
    pooled = json.loads((ds.root / STATS_PATH).read_text())
    close(pooled, stats_from_episodes_meta(ds.episodes_meta()))
    # a stats.json that does not describe the stored frames (a crash between writes) is not
    # pooled from: the next ingest recomputes it from every episode
    bogus = {feature: {**values, "mean": [0.0] * len(values["mean"])} for feature, values in pooled.items()}
    bogus["observation.state"]["count"] = [1]
    (ds.root / STATS_PATH).write_text(json.dumps(bogus))
    ds.add_episodes([make_episode(rng, "robot-0000")])
    close(json.loads((ds.root / STATS_PATH).read_text()), stats_from_episodes_meta(ds.episodes_meta()))


def test_dataset_stats_refuse_rows_of_different_shapes_naming_the_column():
    from components.episodes.stats import stats_from_episodes_meta

    columns = {f"stats/x/{k}": [[0.0, 1.0], [0.0]] for k in ("min", "max", "mean", "std")}
    columns["stats/x/count"] = [[3], [4]]
    with pytest.raises(ValueError, match="stats/x/min has rows of different shapes"):
        stats_from_episodes_meta(pa.table(columns))


def _episode_bytes(episode: Episode) -> bytes:
    return episode_to_ipc(episode)


def _data_files(root: Path) -> list[str]:
    return [f.relative_to(root).as_posix() for f in sorted(root.glob("data/chunk-*/file-*.parquet"))]


def test_the_data_files_of_merged_episodes_table_files_are_merged_too_and_readers_see_the_same(tmp_path, rng):
    """One data file per ingest would make every DVC snapshot walk one file per ingest: when the
    episodes-table files merge, the small data files of their episodes merge with them, in frame
    order, each once. Every reader returns what a dataset that never merged returns; a handle
    opened before the merge still reads (the replaced files wait in .superseded/) until they
    expire, and then says to refresh."""
    from components.episodes import meta_files

    batches = [[make_episode(rng, frames=5 + i), make_episode(rng, "robot-0001")] for i in range(7)]
    plain = EpisodeDataset(tmp_path / "plain", EpisodesConfig(meta_merge_files=1000))
    cfg = EpisodesConfig(meta_merge_files=3)
    merged = EpisodeDataset(tmp_path / "merged", cfg)
    for number, batch in enumerate(batches):
        plain.add_episodes(batch)
        merged.add_episodes(batch)
        if number == 0:
            stale = EpisodeDataset(merged.root, cfg)  # opened before any merge: names data file 0
    assert len(_data_files(plain.root)) == 7
    # ingest 3 merges data 0-2 into 3; ingest 5 writes 4, 5, merges them into 6 (3 was merged: never again);
    # ingest 7 writes 7, 8 and merges them into 9
    assert _data_files(merged.root) == [f"data/chunk-000/file-{n:03d}.parquet" for n in (3, 6, 9)]
    assert sorted(p.name for p in (merged.root / ".superseded").rglob("*.parquet")) == [
        f"file-{n:03d}.parquet" for n in (0, 1, 2, 4, 5, 7, 8)]
    assert pq.read_schema(merged.root / "data/chunk-000/file-003.parquet").metadata[b"fleetloop.merged_files"] == b"3"
    meta_files._cache.clear()
    reopened = EpisodeDataset(merged.root, cfg)
    assert reopened.frames().equals(plain.frames())
    assert [_episode_bytes(e) for e in reopened.episodes()] == [_episode_bytes(e) for e in plain.episodes()]
    order = [9, 0, 13, 4]
    got, want = reopened.episode_columns(order, ("action",)), plain.episode_columns(order, ("action",))
    assert np.array_equal(got["action"], want["action"])
    assert [e.episode_id for e in reopened.load_episodes(order)] == [e.episode_id for e in plain.load_episodes(order)]
    assert reopened.content_hash() == plain.content_hash()
    assert [e.episode_id for e in stale.episodes()] == [e.episode_id for e in batches[0]]  # from .superseded/

    EpisodeDataset(merged.root, cfg.model_copy(update={"superseded_retain_hours": 0})).add_episodes(
        [make_episode(rng)])  # no merge due: nothing expires yet
    assert len(list((merged.root / ".superseded").rglob("*.parquet"))) == 7
    expiring = EpisodeDataset(merged.root, cfg.model_copy(update={"superseded_retain_hours": 0}))
    expiring.add_episodes([make_episode(rng)])
    expiring.add_episodes([make_episode(rng)])  # the third small file since the last merge: a merge, which sweeps
    assert not list((merged.root / ".superseded").rglob("file-000.parquet"))
    with pytest.raises(FileNotFoundError, match=r"file-000\.parquet is missing .*refresh\(\) the dataset handle"):
        list(stale.episodes())
    stale.refresh()
    assert [e.episode_id for e in stale.episodes(0, 2)] == [e.episode_id for e in batches[0]]


def test_a_root_grown_before_data_merging_is_compacted_and_readers_see_the_same(tmp_path, rng):
    """A root whose episodes-table files merged while data files did not (grown before they
    merged together: here data_file_mb below any file) keeps one data file per ingest.
    ``compact_data_files`` merges them, one episodes-table file at a time, by the same commit; the
    episodes, frames and content hash stay, a handle opened before still reads, and a second
    compaction has nothing to do."""
    from components.episodes import meta_files

    batches = [[make_episode(rng, frames=5 + i), make_episode(rng, "robot-0001")] for i in range(7)]
    plain = EpisodeDataset(tmp_path / "plain", EpisodesConfig(meta_merge_files=1000))
    old = EpisodeDataset(tmp_path / "old", EpisodesConfig(meta_merge_files=3, data_file_mb=1e-6))
    for batch in batches:
        plain.add_episodes(batch)
        old.add_episodes(batch)
    assert len(_data_files(old.root)) == 7 and len(_meta_files(old.root)) == 1  # merged meta (0-8 into 9)
    before = EpisodeDataset(old.root, EpisodesConfig())

    cfg = EpisodesConfig(meta_merge_files=3)
    assert EpisodeDataset(old.root, cfg).compact_data_files() == 1
    assert _data_files(old.root) == ["data/chunk-000/file-007.parquet"]  # the 7 in frame order, numbered after
    assert _meta_files(old.root) == ["meta/episodes/chunk-000/file-010.parquet"]
    meta_files._cache.clear()
    reopened = EpisodeDataset(old.root, cfg)
    assert reopened.frames().equals(plain.frames())
    assert [_episode_bytes(e) for e in reopened.episodes()] == [_episode_bytes(e) for e in plain.episodes()]
    assert _without_locations(reopened.episodes_meta()).equals(_without_locations(plain.episodes_meta()))
    assert reopened.content_hash() == plain.content_hash()
    assert [_episode_bytes(e) for e in before.episodes()] == [_episode_bytes(e) for e in plain.episodes()]  # .superseded/
    assert reopened.compact_data_files() == 0 and _data_files(old.root) == ["data/chunk-000/file-007.parquet"]
    reopened.add_episodes([make_episode(rng)])  # ingest goes on after it
    assert len(reopened.episodes_meta()) == 15


def test_data_files_merge_once_in_frame_order_within_the_size_cap():
    """A group is contiguous in frame order, under the cap, of files never merged before."""
    from components.episodes.data_files import DataFile, plan_data_merge

    def f(n: int, first: int, size: int = 10, merged: bool = False) -> DataFile:
        return DataFile((0, n), first, 5, size, merged)

    def keys(groups):
        return [[item.key[1] for item in group] for group in groups]

    assert keys(plan_data_merge([f(2, 10), f(0, 0), f(1, 5)], 100)) == [[0, 1, 2]]
    assert keys(plan_data_merge([f(0, 0), f(1, 5, merged=True), f(2, 10), f(3, 15)], 100)) == [[2, 3]]
    assert keys(plan_data_merge([f(0, 0), f(1, 5), f(2, 11), f(3, 16)], 100)) == [[0, 1], [2, 3]]  # a gap
    assert keys(plan_data_merge([f(0, 0, 40), f(1, 5, 40), f(2, 10, 40), f(3, 15, 100)], 100)) == [[0, 1]]
    assert plan_data_merge([f(0, 0)], 100) == []


def test_a_data_merge_that_dies_after_its_commit_loses_nothing_and_the_next_merge_tidies(tmp_path, rng, monkeypatch):
    """Fault injection: the merge commits (the new episodes-table file names the merged data
    file), then dies before moving the replaced files aside. Every episode reads once and whole;
    the next merge moves the leftovers to .superseded/."""
    from components.episodes import data_files, meta_files

    cfg = EpisodesConfig(meta_merge_files=2)
    ds = EpisodeDataset(tmp_path / "episodes", cfg)
    first = [make_episode(rng), make_episode(rng)]
    ds.add_episodes(first[:1])

    def dies(root, keys):
        raise OSError("killed before moving the merged-away data files")

    monkeypatch.setattr("components.episodes.dataset.supersede", dies)
    with pytest.raises(OSError, match="killed"):
        ds.add_episodes(first[1:])
    monkeypatch.setattr("components.episodes.dataset.supersede", data_files.supersede)
    assert _data_files(ds.root) == [f"data/chunk-000/file-{n:03d}.parquet" for n in (0, 1, 2)]
    meta_files._cache.clear()
    reopened = EpisodeDataset(ds.root, cfg)
    assert [_episode_bytes(e) for e in reopened.episodes()] == [_episode_bytes(e) for e in first]
    reopened.add_episodes([make_episode(rng)])
    reopened.add_episodes([make_episode(rng)])  # a merge: leftovers 0 and 1 move aside with 3 and 4
    assert _data_files(ds.root) == ["data/chunk-000/file-002.parquet", "data/chunk-000/file-005.parquet"]
    assert sorted(p.name for p in (ds.root / ".superseded").rglob("*.parquet")) == [
        f"file-{n:03d}.parquet" for n in (0, 1, 3, 4)]
    assert reopened.num_episodes == 4 and len(list(reopened.episodes())) == 4
