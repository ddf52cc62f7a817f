"""Check one incoming episode table against the contract; reject with a precise reason.

Every rejection names the source, the field, what is wrong and how to fix it, so the operator
reading a quarantine reason file knows what to change on the robot side.
"""

from __future__ import annotations

import uuid
from collections.abc import Set
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from components.episodes.record import Episode
from components.episodes.schema import (
    ACTION,
    BOOKKEEPING_COLUMNS,
    CONTRACT_COLUMNS,
    EPISODE_ID,
    EPISODE_LEVEL_COLUMNS,
    FRAME_INDEX,
    INTERRUPTED,
    OPTIONAL_COLUMNS,
    ROBOT_ID,
    STATE,
    SUCCESS,
    TIMESTAMP,
    canonical_frames,
    list_column_to_numpy,
    table_to_episode,
    table_to_episodes,
)

# The whole table, not one column (e.g. an empty episode or an unreadable file).
WHOLE_FILE = "<file>"
UPLOAD_COLUMNS = frozenset(CONTRACT_COLUMNS) | frozenset(BOOKKEEPING_COLUMNS) | frozenset(OPTIONAL_COLUMNS)
_TYPE_FAMILIES = {"float": pa.types.is_floating, "bool": pa.types.is_boolean, "integer": pa.types.is_integer}


class EpisodeValidationError(ValueError):
    """An episode that breaks the contract. ``str()`` is one line: source, field, reason, fix."""

    def __init__(self, source: str, field: str, reason: str, fix: str) -> None:
        self.source = source
        self.field = field
        self.reason = reason
        self.fix = fix
        super().__init__(f"{source}: field '{field}': {reason}. Fix: {fix}")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_float32_list(t: pa.DataType) -> bool:
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return is_list and pa.types.is_float32(t.value_type)


_EXPECTED_TYPES: dict[str, tuple[str, object]] = {
    EPISODE_ID: ("string", _is_string),
    ROBOT_ID: ("string", _is_string),
    "task": ("string", _is_string),
    "policy_version": ("string", _is_string),
    FRAME_INDEX: ("int64", pa.types.is_int64),
    TIMESTAMP: ("float32", pa.types.is_float32),
    STATE: ("fixed_size_list<float32>[n] (or list<float32>)", _is_float32_list),
    ACTION: ("fixed_size_list<float32>[m] (or list<float32>)", _is_float32_list),
    SUCCESS: ("bool", pa.types.is_boolean),
    INTERRUPTED: ("bool", pa.types.is_boolean),
}


def _check_vectors(table: pa.Table, name: str, dim: int | None, source: str) -> np.ndarray:
    column = table.column(name).combine_chunks()
    if column.null_count:
        raise EpisodeValidationError(
            source, name, f"{column.null_count} frames are null", f"write a {name} vector on every frame"
        )
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        if column.flatten().null_count:
            raise EpisodeValidationError(
                source, name, "vector contains null values", f"write finite float32 values in {name}"
            )
    else:
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        if lengths.size and (lengths != lengths[0]).any():
            bad = int(np.flatnonzero(lengths != lengths[0])[0])
            raise EpisodeValidationError(
                source,
                name,
                f"inconsistent vector length: frame 0 has {lengths[0]}, frame {bad} has {lengths[bad]}",
                f"write the same number of values in {name} on every frame",
            )
        width = int(lengths[0]) if lengths.size else 0
        if column.flatten().null_count:
            raise EpisodeValidationError(
                source, name, "vector contains null values", f"write finite float32 values in {name}"
            )
    if width == 0:
        raise EpisodeValidationError(source, name, "vectors are empty", f"write at least one value in {name}")
    if dim is not None and width != dim:
        raise EpisodeValidationError(
            source,
            name,
            f"shape is [{width}], the dataset expects [{dim}]",
            f"send {dim} values per frame in {name} (the dimension fixed by the dataset's first ingest)",
        )
    values = list_column_to_numpy(column)
    if not np.isfinite(values).all():
        frame = int(np.flatnonzero(~np.isfinite(values).all(axis=1))[0])
        raise EpisodeValidationError(
            source, name, f"NaN or inf at frame {frame}", f"replace non-finite values in {name}"
        )
    return values


def _check_columns(table: pa.Table, source: str) -> None:
    """The schema half of the contract: every contract column, once, with its type."""
    missing = [name for name in CONTRACT_COLUMNS if name not in table.column_names]
    if missing:
        raise EpisodeValidationError(
            source,
            missing[0],
            f"missing column(s) {', '.join(missing)}",
            "write every contract column (see components/episodes/README.md)",
        )
    duplicated = sorted({n for n in table.column_names if table.column_names.count(n) > 1})
    if duplicated:
        raise EpisodeValidationError(
            source, duplicated[0], "column appears more than once", "write each column once"
        )
    slashed = [n for n in table.column_names if "/" in n]
    if slashed:
        raise EpisodeValidationError(
            source, slashed[0], "column names may not contain '/' (LeRobot reserves it)", "rename the column"
        )
    for name, (expected, check) in _EXPECTED_TYPES.items():
        actual = table.schema.field(name).type
        if not check(actual):  # type: ignore[operator]
            raise EpisodeValidationError(
                source, name, f"dtype is {actual}, expected {expected}", f"cast {name} to {expected}"
            )


def check_upload_columns(table: pa.Table, source: str) -> None:
    """The columns an episode *file* may have, at both doors (``fleetloop ingest`` and the fleet
    ingest service): the contract, LeRobot's bookkeeping, and the optional columns with their types.
    An unknown extra could clash with another episode's column of that name (a scalar here, a vector
    there) once stored together, so it is refused wherever the file arrives."""
    extra = sorted(set(table.column_names) - UPLOAD_COLUMNS)
    if extra:
        raise EpisodeValidationError(
            source, extra[0], f"column(s) {extra[:8]} are not in the episode contract",
            f"drop them; an episode file holds the contract columns ({', '.join(CONTRACT_COLUMNS)}) and "
            f"optionally {', '.join(OPTIONAL_COLUMNS)} (components/episodes/README.md)",
        )
    for name in set(table.column_names) & set(OPTIONAL_COLUMNS):
        family, actual = OPTIONAL_COLUMNS[name], table.schema.field(name).type
        if not _TYPE_FAMILIES[family](actual):
            raise EpisodeValidationError(
                source, name, f"dtype is {actual}, expected a {family} scalar per frame", f"cast {name} to a {family} type"
            )


def canonical_episode_id(value: object) -> str | None:
    """A uuid4 in its one stored spelling (lower-case hex, hyphenated: ``str(uuid.UUID(value))``)
    from any spelling the uuid standard admits (upper or mixed case; Python also reads it without
    hyphens, in braces or as a ``urn:uuid:``); None when ``value`` is no uuid4."""
    try:
        parsed = uuid.UUID(value)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        return None
    return str(parsed) if parsed.version == 4 else None


def _with_canonical_ids(table: pa.Table) -> pa.Table:
    """``table`` with every uuid4 episode_id in its canonical spelling (others left for _check_ids)."""
    column = table.column(EPISODE_ID)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return table
    spellings = [v for v in pc.unique(column).to_pylist() if v is not None]
    renamed = {v: c for v in spellings if (c := canonical_episode_id(v)) is not None and c != v}
    if not renamed:
        return table
    values = pa.array([renamed.get(v, v) for v in column.to_pylist()], type=column.type)
    return table.set_column(table.schema.get_field_index(EPISODE_ID), table.schema.field(EPISODE_ID), values)


def validate_episode_table(
    table: pa.Table,
    known_robots: Set[str] | None,
    state_dim: int | None,
    action_dim: int | None,
    source: str,
) -> Episode:
    """Check ``table`` against the episode contract and return it as an Episode.

    ``known_robots=None`` accepts any robot id; ``state_dim``/``action_dim`` ``None`` accept any
    width (the first ingest fixes them). Raises ``EpisodeValidationError`` on the first problem.
    """
    if table.num_rows == 0:
        raise EpisodeValidationError(
            source, WHOLE_FILE, "episode has no frames", "send episodes with at least one frame"
        )
    _check_columns(table, source)
    table = _with_canonical_ids(table)
    for name in (FRAME_INDEX, TIMESTAMP, *EPISODE_LEVEL_COLUMNS):
        nulls = table.column(name).null_count
        if nulls:
            raise EpisodeValidationError(
                source, name, f"{nulls} frames are null", f"write {name} on every frame"
            )
    _check_vectors(table, STATE, state_dim, source)
    _check_vectors(table, ACTION, action_dim, source)

    frames = table.column(FRAME_INDEX).to_numpy()
    expected_frames = np.arange(table.num_rows, dtype=np.int64)
    if not np.array_equal(frames, expected_frames):
        bad = int(np.flatnonzero(frames != expected_frames)[0])
        raise EpisodeValidationError(
            source,
            FRAME_INDEX,
            f"frame_index must be 0..{table.num_rows - 1} in order; row {bad} has {frames[bad]}",
            "number frames 0, 1, 2, ... in row order",
        )
    times = table.column(TIMESTAMP).to_numpy()
    if not np.isfinite(times).all():
        raise EpisodeValidationError(
            source, TIMESTAMP, "NaN or inf timestamp", "write finite seconds from episode start"
        )
    if times[0] < 0:
        raise EpisodeValidationError(
            source, TIMESTAMP, f"first timestamp is negative ({times[0]})", "count seconds from episode start"
        )
    steps = np.diff(times)
    if (steps <= 0).any():
        bad = int(np.flatnonzero(steps <= 0)[0]) + 1
        raise EpisodeValidationError(
            source,
            TIMESTAMP,
            f"timestamps not strictly increasing at frame {bad} ({times[bad - 1]:.6g} -> {times[bad]:.6g})",
            "write strictly increasing seconds from episode start",
        )
    for name in EPISODE_LEVEL_COLUMNS:
        distinct = pc.count_distinct(table.column(name)).as_py()
        if distinct != 1:
            raise EpisodeValidationError(
                source,
                name,
                f"episode-level field has {distinct} different values",
                f"write one constant {name} on every frame of an episode",
            )

    _check_ids(table.column(EPISODE_ID)[0].as_py(), table.column(ROBOT_ID)[0].as_py(), known_robots, source)
    return table_to_episode(table)


def _check_ids(episode_id: str, robot_id: str, known_robots: Set[str] | None, source: str) -> None:
    if canonical_episode_id(episode_id) != episode_id:  # canonical already, when it is a uuid4
        raise EpisodeValidationError(
            source,
            EPISODE_ID,
            f"{episode_id!r} is not a uuid4",
            "use str(uuid.uuid4()) (or components.episodes.record.new_episode_id) as episode_id",
        )
    if known_robots is not None and robot_id not in known_robots:
        raise EpisodeValidationError(
            source,
            ROBOT_ID,
            f"unknown robot {robot_id!r}",
            "register the robot (fleet.extra_robots in params.yaml) or fix the robot_id",
        )


@dataclass(frozen=True)
class ValidatedBatch:
    """Episodes that passed together: ``frames`` holds their canonical frames back to back
    (``bounds[i]:bounds[i + 1]`` is episode i), as ``episode_to_table`` gives each one."""

    episodes: list[Episode]
    frames: pa.Table
    bounds: np.ndarray


def validate_episode_batch(
    tables: list[pa.Table],
    known_robots: Set[str] | None,
    state_dim: int | None,
    action_dim: int | None,
) -> ValidatedBatch | None:
    """``validate_episode_table``'s checks run once over the concatenation of ``tables`` (one
    schema), instead of once per table: what a batch of many short episodes would otherwise pay
    per episode. Returns None when any table breaks any check, or the tables differ in schema:
    validate each table on its own then, for the error that names its file and field. A batch
    that passes here passes there table by table, with the same widths."""
    lengths = [t.num_rows for t in tables]
    if not tables or min(lengths) == 0 or any(not t.schema.equals(tables[0].schema) for t in tables[1:]):
        return None
    try:
        _check_columns(tables[0], "")
        table = _with_canonical_ids(pa.concat_tables(tables))
        if any(table.column(n).null_count for n in (FRAME_INDEX, TIMESTAMP, *EPISODE_LEVEL_COLUMNS)):
            return None
        states = _check_vectors(table, STATE, state_dim, "")
        actions = _check_vectors(table, ACTION, action_dim, "")
    except EpisodeValidationError:
        return None
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    starts = np.repeat(bounds[:-1], lengths)  # each frame's episode start
    if not _frames_and_times_hold(table, bounds, starts) or not _constant_per_episode(table, starts):
        return None
    first = pa.array(bounds[:-1])
    ids = table.column(EPISODE_ID).take(first).to_pylist()
    robots = table.column(ROBOT_ID).take(first).to_pylist()
    try:
        for episode_id, robot_id in zip(ids, robots):
            _check_ids(episode_id, robot_id, known_robots, "")
    except EpisodeValidationError:
        return None
    frames = canonical_frames(table, states, actions)
    return ValidatedBatch(table_to_episodes(table, lengths), frames, bounds)


def _frames_and_times_hold(table: pa.Table, bounds: np.ndarray, starts: np.ndarray) -> bool:
    """frame_index 0..n-1 in each episode; timestamps finite, from >= 0, strictly increasing."""
    frames = table.column(FRAME_INDEX).to_numpy()
    if not np.array_equal(frames, np.arange(len(frames), dtype=np.int64) - starts):
        return False
    times = table.column(TIMESTAMP).to_numpy()
    if not np.isfinite(times).all() or (times[bounds[:-1]] < 0).any():
        return False
    steps = np.delete(np.diff(times), bounds[1:-1] - 1)  # not across two episodes
    return not (steps <= 0).any()


def _constant_per_episode(table: pa.Table, starts: np.ndarray) -> bool:
    index = pa.array(starts)
    return all(pc.all(pc.equal(table.column(n), table.column(n).take(index))).as_py() for n in EPISODE_LEVEL_COLUMNS)
