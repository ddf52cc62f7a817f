"""The store's writes: cut and encode episodes into segment rows, then merge them idempotently.

``upsert`` dedupes the batch, drops rows whose stored content is already identical (so a no-op
re-ingest commits nothing and the table version does not move), appends the rows whose
``segment_id`` is not stored and ``merge_insert``s the changed ones (a merge joins against the
whole table; an append costs what the batch costs). One writer at a time: an ``flock`` beside a
local table; on an object store (``store.uri = s3://…``, location.py) a lock per process, and
one writing process per store is the deployment's promise (README: "Writers"). Every commit is
atomic, so an upsert that fails (bad input, crash) leaves the table at a valid version; rerunning
it finishes the job.
"""

from __future__ import annotations

import dataclasses
import fcntl
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from components.config import StoreConfig
from components.episodes.record import Episode
from components.store.encoder import WindowEncoder, encode_episodes
from components.store.reports import UpsertReport
from components.store.scan import vectors_of
from components.store.schema import CONTENT_COLUMNS, VECTOR, segment_schema, sql_in
from components.store.windows import cut_windows, window_count

ProgressCallback = Callable[[int, int], None]
# writers of a table on an object store, per process (no file to flock): table URI -> lock
_REMOTE_WRITE_LOCKS: dict[str, threading.Lock] = {}
_REMOTE_WRITE_LOCKS_GUARD = threading.Lock()


class SegmentWrites:
    """Upserts of episodes or of ready segment rows, under the write lock.

    Part of ``SegmentStore`` (segment_store.py), whose handle holds ``_table``, ``cfg``, ``dim``,
    ``location``, ``read_only`` and ``consistency``.
    """

    def _writable(self) -> None:
        self._resident_checked = -math.inf  # the next single query sees this handle's write
        if self.read_only:
            raise ValueError(
                f"this SegmentStore is a read-only view at version {self.version}; "
                "write through the handle returned by SegmentStore.open"
            )
        self._to_latest()

    def _to_latest(self) -> None:
        """A "step" handle moves to the latest version before it writes (a "strong" one is there)."""
        if self.consistency == "step":
            self._table.checkout_latest()

    def upsert(
        self,
        episodes: Sequence[Episode],
        encoder: WindowEncoder,
        snapshot: str,
        on_progress: ProgressCallback | None = None,
    ) -> UpsertReport:
        """Cut, encode and merge episodes' segments; idempotent (see the module doc).

        Commits in batches of about ``cfg.upsert_batch_rows`` segments (whole episodes per
        batch); ``on_progress(done_episodes, total_episodes)`` is called after each batch.
        Everything that can be checked without encoding is checked before the first commit.
        """
        self._writable()
        version_before = self.version
        unique = _dedupe_episodes(episodes)
        _validate_episodes(unique, snapshot)
        fingerprint = self._check_encoder(encoder)

        total = len(unique)
        inserted = updated = unchanged = segments = commits = done = 0
        for batch in _episode_batches(unique, self.cfg):
            rows = self._segment_rows(batch, encoder, snapshot)
            segments += rows.num_rows
            merged = self._merge(rows, encoder, fingerprint)
            inserted, updated = inserted + merged.inserted, updated + merged.updated
            unchanged, commits = unchanged + merged.unchanged, commits + merged.commits
            done += len(batch)
            if on_progress is not None:
                on_progress(done, total)
        return UpsertReport(
            episodes=total,
            duplicate_episodes=len(episodes) - total,
            segments=segments,
            inserted=inserted,
            updated=updated,
            unchanged=unchanged,
            commits=commits,
            version_before=version_before,
            version_after=self.version,
        )

    def segment_rows(self, episodes: Sequence[Episode], encoder: WindowEncoder, snapshot: str) -> pa.Table:
        """Cut and encode episodes into segment rows without writing anything.

        Lets embedding fan out (one task per episode file, cached on its content) while a single
        writer merges the rows with ``upsert_rows``.
        """
        unique = _dedupe_episodes(episodes)
        _validate_episodes(unique, snapshot)
        self._check_encoder(encoder)
        return self._segment_rows(unique, encoder, snapshot)

    def upsert_rows(self, rows: pa.Table, encoder: WindowEncoder, absent_at_rows: int = -1) -> UpsertReport:
        """Merge rows made by ``segment_rows`` with ``encoder``; idempotent like ``upsert``.

        ``absent_at_rows``: a row count at which the caller knows the table holds no segment of
        these rows' episodes (``EmbedCursor.rows``). If the table has exactly that many rows when
        the write lock is taken, the rows are appended without looking them up; otherwise (a
        writer came between, a crash left rows behind) they are looked up as always.
        """
        self._writable()
        if rows.schema.remove_metadata() != segment_schema(self.dim).remove_metadata():
            raise ValueError(
                f"segment rows have schema {rows.schema}, expected the segment table's; "
                "make them with SegmentStore.segment_rows"
            )
        rows = _dedupe_rows(rows)
        version_before = self.version
        merged = self._merge(rows, encoder, self._check_encoder(encoder), absent_at_rows)
        episodes = len(set(rows.column("episode_id").to_pylist()))
        return dataclasses.replace(merged, episodes=episodes, segments=rows.num_rows, version_before=version_before, version_after=self.version)

    @contextmanager
    def _write_lock(self) -> Iterator[None]:
        """One writer between "which keys are stored" and the write: two processes appending
        the same new segments would otherwise both insert them. An object store has no file to
        lock: writers in this process take turns, and one process writes (README: "Writers")."""
        folder = self.location.local_path
        if folder is None:
            with _remote_write_lock(self.location.table_uri(self.cfg.table)):
                self._to_latest()
                yield
            return
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f".{self.cfg.table}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._to_latest()  # another writer may have committed while this one waited
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _merge(self, rows: pa.Table, encoder: WindowEncoder, fingerprint: str, absent_at_rows: int = -1) -> UpsertReport:
        """Write one batch: new segments appended, changed ones merged (nothing when unchanged)."""
        with self._write_lock():
            return self._merge_locked(rows, encoder, fingerprint, absent_at_rows)

    def _merge_locked(self, rows: pa.Table, encoder: WindowEncoder, fingerprint: str, absent_at_rows: int) -> UpsertReport:
        if self.encoder_fingerprint() is None and rows.num_rows:
            self._record_encoder(encoder, fingerprint)
        episode_ids = sorted(set(rows.column("episode_id").to_pylist()))
        rows_before = self.count()
        looked_up = absent_at_rows < 0 or rows_before != absent_at_rows
        if looked_up:
            new, changed, stored_before = self._new_and_changed_rows(rows, episode_ids)
        else:
            new, changed, stored_before = rows, rows.slice(0, 0), 0
        commits = 0
        if changed.num_rows:
            result = (
                self._table.merge_insert("segment_id")
                .when_matched_update_all()
                .when_not_matched_insert_all()
                .execute(changed)
            )
            commits += 1
        if new.num_rows:
            # keys known absent: a plain append, whose cost follows the batch (a merge joins
            # against the whole table)
            self._table.add(new)
            commits += 1
        return UpsertReport(
            episodes=len(episode_ids), duplicate_episodes=0, segments=rows.num_rows, inserted=new.num_rows,
            updated=changed.num_rows, unchanged=rows.num_rows - new.num_rows - changed.num_rows,
            commits=commits, version_before=-1, version_after=-1,
            rows_before=rows_before, rows_after=self.count(), stored_before=stored_before, looked_up=looked_up,
        )

    def _segment_rows(
        self, episodes: Sequence[Episode], encoder: WindowEncoder, snapshot: str
    ) -> pa.Table:
        cut = [cut_windows(e.states, self.cfg.window, self.cfg.stride) for e in episodes]
        counts = np.array([len(w) for w in cut], dtype=np.int64)
        windows = int(counts.sum())
        vectors = encode_episodes(encoder, episodes, cut)  # a camera encoder also gets each episode's camera windows
        if vectors.shape != (windows, self.dim):
            raise ValueError(
                f"encoder.encode returned shape {vectors.shape}, expected "
                f"({windows}, {self.dim}) for column 'vector'; fix the encoder's dim"
            )
        if not np.isfinite(vectors).all():
            raise ValueError("encoder.encode produced NaN/inf for column 'vector'; check its fit")
        starts = np.concatenate([w.starts for w in cut])
        ends = np.concatenate([w.ends for w in cut])
        episode_ids = np.repeat(np.array([e.episode_id for e in episodes], dtype=object), counts)
        segment_ids = [f"{e}:{s}" for e, s in zip(episode_ids, starts.tolist(), strict=True)]

        def per_episode(values: list[object]) -> np.ndarray:
            return np.repeat(np.array(values, dtype=object), counts)

        flat = pa.array(vectors.astype(np.float32, copy=False).reshape(-1), type=pa.float32())
        return pa.table(
            {
                "segment_id": segment_ids,
                "episode_id": episode_ids,
                "robot_id": per_episode([e.robot_id for e in episodes]),
                "task": per_episode([e.task for e in episodes]),
                "start": starts,
                "end": ends,
                "success": np.repeat(np.array([bool(e.success) for e in episodes]), counts),
                VECTOR: pa.FixedSizeListArray.from_arrays(flat, self.dim),
                "policy_version": per_episode([e.policy_version for e in episodes]),
                "snapshot": pa.array([snapshot] * len(segment_ids), type=pa.string()),
            },
            schema=segment_schema(self.dim),
        )

    def _new_and_changed_rows(self, rows: pa.Table, episode_ids: list[str]) -> tuple[pa.Table, pa.Table, int]:
        """(rows whose segment_id is not stored, stored rows whose content differs, how many rows
        these episodes had), ignoring ``snapshot``. Complete because a segment_id names its
        episode, and every stored row of these episodes is looked up."""
        if self.count() == 0:
            return rows, rows.slice(0, 0), 0
        stored = (
            self._table.search()
            .where(sql_in("episode_id", episode_ids))
            .select(["segment_id", *CONTENT_COLUMNS, VECTOR])
            .limit(None)
            .to_arrow()
        )
        if stored.num_rows == 0:
            return rows, rows.slice(0, 0), 0
        position = pc.index_in(rows.column("segment_id"), value_set=stored.column("segment_id"))
        present = position.is_valid().to_numpy(zero_copy_only=False)
        same = present.copy()
        index = position.filter(position.is_valid())
        old = stored.take(index)
        new = rows.filter(pa.array(present))
        equal = np.ones(new.num_rows, dtype=bool)
        for name in CONTENT_COLUMNS:
            equal &= pc.equal(new.column(name), old.column(name)).to_numpy(zero_copy_only=False)
        new_vectors = vectors_of(new.column(VECTOR), self.dim)
        old_vectors = vectors_of(old.column(VECTOR), self.dim)
        equal &= (new_vectors == old_vectors).all(axis=1)
        same[present] = equal
        return rows.filter(pa.array(~present)), rows.filter(pa.array(present & ~same)), stored.num_rows


@contextmanager
def _remote_write_lock(table_uri: str) -> Iterator[None]:
    with _REMOTE_WRITE_LOCKS_GUARD:
        lock = _REMOTE_WRITE_LOCKS.setdefault(table_uri, threading.Lock())
    with lock:
        yield


def _dedupe_episodes(episodes: Sequence[Episode]) -> list[Episode]:
    """One episode per episode_id, the last occurrence winning, in first-seen order."""
    last: dict[str, Episode] = {}
    for episode in episodes:
        last[episode.episode_id] = episode
    return list(last.values())


def _dedupe_rows(rows: pa.Table) -> pa.Table:
    """One row per segment_id, the last occurrence winning (merge_insert inserts both otherwise)."""
    ids = rows.column("segment_id").to_pylist()
    last = {segment_id: i for i, segment_id in enumerate(ids)}
    if len(last) == len(ids):
        return rows
    return rows.take(pa.array(sorted(last.values())))


def _validate_episodes(episodes: Sequence[Episode], snapshot: str) -> None:
    if not isinstance(snapshot, str):
        raise ValueError(f"snapshot must be a string (the DVC snapshot hash), got {type(snapshot)}")
    state_dims: set[int] = set()
    for episode in episodes:
        where = f"episode {episode.episode_id!r}"
        if not isinstance(episode.episode_id, str) or not episode.episode_id:
            raise ValueError(f"{where}: episode_id must be a non-empty string")
        for name in ("robot_id", "task", "policy_version"):
            if not isinstance(getattr(episode, name), str):
                raise ValueError(f"{where}: {name} must be a string")
        states = np.asarray(episode.states)
        if states.ndim != 2 or states.shape[0] < 1:
            raise ValueError(f"{where}: observation.state must be (T >= 1, n), got {states.shape}")
        if not np.issubdtype(states.dtype, np.number) or not np.isfinite(states).all():
            raise ValueError(f"{where}: observation.state must be finite numbers; validate ingest")
        state_dims.add(int(states.shape[1]))
    if len(state_dims) > 1:
        raise ValueError(
            f"episodes mix observation.state dims {sorted(state_dims)}; one store holds one "
            "robot state layout — upsert them into separate tables"
        )


def _episode_batches(episodes: Sequence[Episode], cfg: StoreConfig) -> Iterator[list[Episode]]:
    batch: list[Episode] = []
    rows = 0
    for episode in episodes:
        batch.append(episode)
        rows += window_count(episode.length, cfg.window, cfg.stride)
        if rows >= cfg.upsert_batch_rows:
            yield batch
            batch, rows = [], 0
    if batch:
        yield batch
