"""The segment store: one LanceDB table of window embeddings, one row per segment.

Row contract (DESIGN.md): ``segment_id`` = f"{episode_id}:{start}", ``episode_id``,
``robot_id``, ``task``, ``start``, ``end`` (exclusive frame), ``success``, ``vector``
(fixed_size_list<float32>[dim]), ``policy_version``, ``snapshot``.

Writes are idempotent: ``upsert`` dedupes the batch, drops rows whose stored content is already
identical (so a no-op re-ingest commits nothing and the table version does not move), appends
the rows whose ``segment_id`` is not stored and ``merge_insert``s the changed ones (a merge joins
against the whole table; an append costs what the batch costs). One writer at a time: an
``flock`` beside a local table; on an object store (``store.uri = s3://…``, location.py) a lock
per process, and one writing process per store is the deployment's promise (README: "Writers").
Every commit is atomic, so an upsert that fails (bad input, crash) leaves the table at a valid
version; rerunning it finishes the job.

LanceDB facts this relies on (checked on 0.40, see STACK-NOTES.md): every write — even a
merge_insert that changes nothing — makes a new version; duplicate keys inside one
merge_insert batch are both inserted; IVF_PQ on < 256 rows indexes nothing; querying with a
metric other than the index's silently scans flat; a handle sees other processes' writes only
with ``read_consistency_interval=timedelta(0)``; forked children hang, so use ``spawn``; every
call on a table (version, count, schema, query) is one round trip to LanceDB's background event
loop, which a loaded host makes cost milliseconds, so the single-query path makes as few as it can.
With that interval every call also finds the latest version by listing ``_versions/``, so on a
local folder its cost grows with the versions kept (0.1 ms at 10, ~1 ms at 2,000, ~2 ms at 3,000):
a one-step writer opens with ``consistency="step"`` instead (``SegmentStore.open``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lancedb.index import Bitmap, BTree
from lancedb.query import LanceQueryBuilder
from lancedb.table import IndexStatistics

from components.config import StoreConfig
from components.episodes.record import Episode
from components.store.encoder import WindowEncoder, encoder_fingerprint, encoder_from_state_dict
from components.store.index_plan import IVF_MIN_ROWS, IndexPlan, plan_index, search_params
from components.store.location import StoreLocation, table_bytes
from components.store.scan import scan_nearest, vectors_of
from components.store.windows import cut_windows, window_count

if TYPE_CHECKING:
    from components.store.resident import ResidentIndex

VECTOR = "vector"
Consistency = Literal["strong", "step"]  # SegmentStore.open
# Metadata on the vector field: which encoder made the vectors (fingerprint + JSON state).
ENCODER_FINGERPRINT_KEY = "fleetloop:encoder_fingerprint"
ENCODER_STATE_KEY = "fleetloop:encoder_state"
ENCODER_STATE_MAX_BYTES = 1 << 20  # larger encoder states (learned nets) store only the fingerprint
# ... the rows the vector index was last built on (upkeep rebuilds it as the table grows) ...
INDEX_ROWS_KEY = "fleetloop:index_rows"
# ... and how far the dataset's episodes are embedded (see EmbedCursor).
EMBED_CURSOR_KEY = "fleetloop:embed_cursor"
# Pruning stops this long before the oldest tagged version: LanceDB 0.40 refuses to prune a
# tagged version (it cannot be told to skip them), and it fixes its cutoff only when it gets to
# the prune step, after compaction.
TAG_PRUNE_MARGIN = timedelta(hours=1)
# Columns compared to decide whether a row changed. ``snapshot`` is left out on purpose: it
# records the snapshot that last *changed* the row, so re-ingesting under a new snapshot is a no-op.
CONTENT_COLUMNS = ("episode_id", "robot_id", "task", "start", "end", "success", "policy_version")
RESULT_COLUMNS = ("segment_id", "episode_id", "robot_id", "start", "end", "success")
# Scalar indexes built with the vector index: they make prefilters and the idempotency check
# look rows up instead of scanning (measured at 290k rows: exclude-episode query 35 -> 9 ms).
SCALAR_INDEXES = (("episode_id", BTree), ("success", Bitmap), ("task", Bitmap), ("robot_id", Bitmap))

ProgressCallback = Callable[[int, int], None]
# writers of a table on an object store, per process (no file to flock): table URI -> lock
_REMOTE_WRITE_LOCKS: dict[str, threading.Lock] = {}
_REMOTE_WRITE_LOCKS_GUARD = threading.Lock()


def segment_schema(dim: int) -> pa.Schema:
    """The Arrow schema of the segment table for vectors of length ``dim``."""
    return pa.schema(
        [
            pa.field("segment_id", pa.string(), nullable=False),
            pa.field("episode_id", pa.string(), nullable=False),
            pa.field("robot_id", pa.string(), nullable=False),
            pa.field("task", pa.string(), nullable=False),
            pa.field("start", pa.int64(), nullable=False),
            pa.field("end", pa.int64(), nullable=False),
            pa.field("success", pa.bool_(), nullable=False),
            pa.field(VECTOR, pa.list_(pa.float32(), dim), nullable=False),
            pa.field("policy_version", pa.string(), nullable=False),
            pa.field("snapshot", pa.string(), nullable=False),
        ]
    )


@dataclass(frozen=True)
class UpsertReport:
    """What one ``upsert`` did. ``version_after == version_before`` when nothing changed."""

    episodes: int  # distinct episodes given
    duplicate_episodes: int  # repeats of an episode_id in the same call (last one kept)
    segments: int  # segments cut from the distinct episodes
    inserted: int
    updated: int
    unchanged: int
    commits: int
    version_before: int
    version_after: int
    # the table's row count before and after the write, read under the write lock (-1: a
    # multi-commit ``upsert``); the embed cursor chains on them (EmbedCursor.rows)
    rows_before: int = -1
    rows_after: int = -1
    stored_before: int = -1  # of rows_before, the rows of these episodes (the lookup's hits)
    looked_up: bool = True  # False: the stored rows were known to hold none of these episodes

    @property
    def changed(self) -> bool:
        return self.inserted + self.updated > 0


@dataclass(frozen=True)
class EmbedCursor:
    """How far a dataset's episodes are embedded: the first ``episodes`` (in episode_index
    order) all have segments, the last of them being ``last_episode_id``.

    Kept in the table's metadata, so it travels with the table (and its versions). The id lets a
    reader check the cursor still describes *this* dataset before trusting it.
    """

    episodes: int
    last_episode_id: str
    # the table's row count when every stored segment belonged to those episodes (-1: not
    # known, e.g. a store written before this field). While the table still has exactly that
    # many rows, the episodes after the cursor have no segments, and their upsert skips
    # looking them up (a cold lookup of 200 episodes in a 2.4M-row table: 70-150 ms)
    rows: int = -1


@dataclass(frozen=True)
class UpkeepReport:
    """What ``SegmentStore.upkeep`` did: compaction, index fold or rebuild, version pruning."""

    version_before: int
    version_after: int
    versions_before: int  # versions on disk
    versions_after: int
    bytes_before: int  # bytes of the table's directory
    bytes_after: int
    fragments_before: int
    fragments_after: int
    index_built: bool  # first vector-index build (the table crossed store.vector_index_min_rows)
    # retrained: the table grew store.index_rebuild_growth× since the last build, or its index
    # is not of store.index_type (a store indexed before the type changed)
    index_rebuilt: bool
    indexed: bool  # a vector index exists afterwards
    pruned_before: datetime  # versions older than this were deleted (tagged ones are kept)
    tags: dict[str, int]  # the tagged versions kept for lineage

    @property
    def index_action(self) -> str:
        if self.index_built or self.index_rebuilt:
            return "built" if self.index_built else "retrained"
        return "new rows folded in" if self.indexed else "none yet (below store.vector_index_min_rows)"


@dataclass(frozen=True)
class SearchResult:
    """k nearest segments per query, as (Q, k) arrays; a query with fewer hits is padded.

    Padding: ``segment_ids``/``episode_ids``/``robot_ids`` = "", ``starts``/``ends`` = -1,
    ``success`` = False, ``distances`` = inf. ``counts[q]`` is the number of real hits and
    ``valid`` masks them. Distances are in the store's metric (squared L2 for "l2").
    """

    segment_ids: np.ndarray  # (Q, k) object (str)
    episode_ids: np.ndarray  # (Q, k) object (str)
    robot_ids: np.ndarray  # (Q, k) object (str)
    starts: np.ndarray  # (Q, k) int64
    ends: np.ndarray  # (Q, k) int64
    success: np.ndarray  # (Q, k) bool
    distances: np.ndarray  # (Q, k) float32, ascending per row
    counts: np.ndarray  # (Q,) int64
    metric: str
    version: int  # table version the search read

    @property
    def valid(self) -> np.ndarray:
        return np.isfinite(self.distances)

    def __len__(self) -> int:
        return int(self.distances.shape[0])


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _sql_in(column: str, values: Iterable[str]) -> str:
    return f"{column} IN ({', '.join(_sql_str(v) for v in values)})"


class SegmentStore:
    """A handle on the segment table. Create with ``SegmentStore.open``; see the module doc."""

    def __init__(
        self, table: lancedb.table.Table, cfg: StoreConfig, dim: int, location: StoreLocation, read_only: bool,
        consistency: Consistency = "strong",
    ) -> None:
        self._table = table
        self.cfg = cfg
        self.dim = dim
        self.location = location
        self.read_only = read_only
        self.consistency = consistency
        self._index_type_seen: tuple[int, str | None] | None = None  # (table version, its vector index type)
        # (table version, its resident index or None when too large): built on first use
        self._resident: tuple[int, ResidentIndex | None] | None = None
        self._resident_checked = -math.inf  # monotonic time the table's version was last compared with it

    @property
    def uri(self) -> str:
        """The store's folder or object-store URI, as people may see it."""
        return self.location.shown

    # ------------------------------------------------------------------ open / lineage

    @classmethod
    def open(
        cls, uri: Path | StoreLocation, cfg: StoreConfig, dim: int, consistency: Consistency = "strong"
    ) -> SegmentStore:
        """Open (or create) ``cfg.table`` under the LanceDB directory or object-store URI ``uri``
        (a ``StoreLocation``: ``store_location``; a path is a local folder).

        ``consistency="strong"``: the handle re-reads the latest version on every operation, so a
        long-lived handle (a service, the fleet's trainer) sees writes made by other handles and
        processes. ``"step"``, for a handle that lives one step (an ingest): reads see the version
        at open plus the handle's own writes, and every write first moves to the latest version
        (again once it holds the write lock), so writes build on what others committed, as with
        "strong". It saves the latest-version lookup on every other call (see the module doc).
        An object store that does not answer within the configured retries raises
        ``SegmentStoreError`` (one line: the store, its endpoint, the fix).
        """
        if dim < 1:
            raise ValueError(f"segment vector dim must be >= 1, got {dim}")
        if consistency not in ("strong", "step"):
            raise ValueError(f"consistency must be 'strong' or 'step', got {consistency!r}")
        location = uri if isinstance(uri, StoreLocation) else StoreLocation(str(Path(uri)))
        try:
            table = _open_or_create(location, cfg.table, dim, strong=consistency == "strong")
        except (OSError, ValueError, RuntimeError) as exc:
            if not location.remote:
                raise
            raise location.unreachable(exc) from None
        store = cls(table, cfg, dim, location, read_only=False, consistency=consistency)
        store._check_schema()
        return store

    def _check_schema(self) -> None:
        schema = self._table.schema
        expected = segment_schema(self.dim)
        missing = [f.name for f in expected if f.name not in schema.names]
        if missing:
            raise ValueError(
                f"{self.uri}/{self.cfg.table}: not a segment table, missing columns {missing}; "
                "point store.table at a new name or delete the directory"
            )
        stored = schema.field(VECTOR).type
        if stored != expected.field(VECTOR).type:
            size = getattr(stored, "list_size", stored)
            raise ValueError(
                f"{self.uri}/{self.cfg.table}: column 'vector' has dim {size}, but dim={self.dim} "
                "was asked for; open with the encoder's dim (encoder.dim) or use a new table"
            )

    @property
    def version(self) -> int:
        """The table version this handle reads (latest, unless checked out). Log it for lineage."""
        return int(self._table.version)

    def count(self, where: str | None = None) -> int:
        return int(self._table.count_rows(where))

    def episode_ids(self) -> set[str]:
        """Every episode with segments in the table (to find episodes still to embed)."""
        if self.count() == 0:
            return set()
        column = self._table.search().select(["episode_id"]).limit(None).to_arrow().column("episode_id")
        return set(column.unique().to_pylist())

    def checkout(self, version: int | str) -> SegmentStore:
        """A read-only view of the table at ``version`` (a number or a tag name)."""
        table = _connect(self.location).open_table(self.cfg.table)
        table.checkout(version)
        return SegmentStore(table, self.cfg, self.dim, self.location, read_only=True)

    def tag(self, name: str, version: int | None = None) -> int:
        """Name a version (default: the current one) so it survives cleanup; returns it."""
        version = self.version if version is None else version
        self._table.tags.create(name, version)
        return version

    def tags(self) -> dict[str, int]:
        return {name: int(info["version"]) for name, info in self._table.tags.list().items()}

    def untag(self, name: str) -> None:
        """Drop a tag: its version becomes prunable by ``optimize`` once it is old enough."""
        self._table.tags.delete(name)

    # ------------------------------------------------------------------ embed cursor

    def embed_cursor(self) -> EmbedCursor | None:
        """How far the dataset is embedded (None: never recorded, e.g. a new table)."""
        blob = (self._table.schema.field(VECTOR).metadata or {}).get(EMBED_CURSOR_KEY.encode())
        if not blob:
            return None
        # fields a newer writer added are skipped, so an older reader keeps working
        known = {f.name for f in dataclasses.fields(EmbedCursor)}
        return EmbedCursor(**{k: v for k, v in json.loads(blob).items() if k in known})

    def set_embed_cursor(self, cursor: EmbedCursor) -> None:
        """Record the cursor (one small commit; none when it is unchanged, so a no-op ingest
        keeps the version). Call it only after the episodes it covers are upserted."""
        self._writable()
        if cursor == self.embed_cursor():
            return
        blob = json.dumps(dataclasses.asdict(cursor), sort_keys=True)
        self._table.update_field_metadata({"path": VECTOR, "metadata": {EMBED_CURSOR_KEY: blob}})

    def recount_embed_cursor(self, covered_ids: Callable[[EmbedCursor], set[str]]) -> EmbedCursor | None:
        """Restore the cursor's ``rows`` (-1 after a writer it did not know, or from a store
        written before it counted rows): if every stored segment belongs to ``covered_ids(cursor)``
        (the dataset's first ``cursor.episodes`` episodes), record today's row count. Reads every
        ``episode_id`` once (seconds at millions of rows: upkeep's job, not ingest's); holds the
        write lock, so no write comes between the scan and the count. Returns the cursor after."""
        self._writable()
        with self._write_lock():
            cursor = self.embed_cursor()
            if cursor is None or cursor.rows >= 0:
                return cursor
            if not self.episode_ids() <= covered_ids(cursor):
                return cursor
            recounted = dataclasses.replace(cursor, rows=self.count())
            self.set_embed_cursor(recounted)
            return recounted

    # ------------------------------------------------------------------ encoder bookkeeping

    def encoder_fingerprint(self) -> str | None:
        """Fingerprint of the encoder that made the stored vectors (None while empty)."""
        meta = self._table.schema.field(VECTOR).metadata or {}
        value = meta.get(ENCODER_FINGERPRINT_KEY.encode())
        return value.decode() if value else None

    def load_encoder(self) -> WindowEncoder | None:
        """The encoder saved with the store (None if never written or too large to keep)."""
        meta = self._table.schema.field(VECTOR).metadata or {}
        blob = meta.get(ENCODER_STATE_KEY.encode())
        return encoder_from_state_dict(json.loads(blob)) if blob else None

    def _check_encoder(self, encoder: WindowEncoder) -> str:
        if encoder.dim != self.dim:
            raise ValueError(
                f"encoder.dim={encoder.dim} but the store's 'vector' column has dim={self.dim}; "
                "open the store with dim=encoder.dim (a new table), or use the store's encoder "
                "(store.load_encoder())"
            )
        fingerprint = encoder_fingerprint(encoder)
        stored = self.encoder_fingerprint()
        if stored is not None and stored != fingerprint:
            raise ValueError(
                f"encoder fingerprint {fingerprint} differs from {stored}, the one that made the "
                f"vectors in {self.uri}/{self.cfg.table}; mixing them makes distances meaningless. "
                "Upsert with store.load_encoder(), or re-embed every episode into a new table"
            )
        return fingerprint

    def _record_encoder(self, encoder: WindowEncoder, fingerprint: str) -> None:
        metadata = {ENCODER_FINGERPRINT_KEY: fingerprint}
        blob = json.dumps(encoder.state_dict(), sort_keys=True)
        if len(blob) <= ENCODER_STATE_MAX_BYTES:
            metadata[ENCODER_STATE_KEY] = blob
        self._table.update_field_metadata({"path": VECTOR, "metadata": metadata})

    # ------------------------------------------------------------------ writes

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
        windows = np.concatenate([w.windows for w in cut], axis=0)
        vectors = np.asarray(encoder.encode(windows))
        if vectors.shape != (windows.shape[0], self.dim):
            raise ValueError(
                f"encoder.encode returned shape {vectors.shape}, expected "
                f"({windows.shape[0]}, {self.dim}) for column 'vector'; fix the encoder's dim"
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
            .where(_sql_in("episode_id", episode_ids))
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

    # ------------------------------------------------------------------ index

    def _indexed_columns(self) -> dict[str, str]:
        return {idx.columns[0]: idx.name for idx in self._table.list_indices()}

    def has_index(self) -> bool:
        return VECTOR in self._indexed_columns()

    def ensure_index(self) -> bool:
        """Index upkeep on the ingest path. From ``cfg.index_min_rows`` rows: scalar indexes on
        the filter columns (upserts' episode lookups, filtered scans). From
        ``cfg.vector_index_rows``: the vector index (``cfg.index_type``, ``cfg.metric``), which
        answers single queries once the table outgrows the resident copy. Afterwards new rows
        are folded into the indexes (``optimize``) once ``cfg.index_fold_rows`` are unindexed.

        Returns whether a vector index exists afterwards. Unfolded rows are still found (searched
        flat). An existing index built with another metric raises (queries would scan flat); one
        of another type is kept (searched with its own keys) until ``upkeep`` rebuilds it.
        """
        indexed = self._indexed_columns()
        if VECTOR in indexed:
            stats = self._table.index_stats(indexed[VECTOR])
            if stats is not None and stats.distance_type != self.cfg.metric:
                raise ValueError(
                    f"the vector index of {self.uri}/{self.cfg.table} uses metric "
                    f"{stats.distance_type!r} but store.metric is {self.cfg.metric!r}; set "
                    f"store.metric back, or call store.rebuild_index()"
                )
            self._ensure_scalar_indexes(indexed)
            self._fold_if_due(stats)
            return True
        rows = self.count()
        if rows >= max(self.cfg.vector_index_rows, IVF_MIN_ROWS):
            self._build_vector_index(rows)
            self._ensure_scalar_indexes(self._indexed_columns())
            return True
        if rows >= self.cfg.index_min_rows:
            if all(column in indexed for column, _ in SCALAR_INDEXES):
                self._fold_if_due(self._table.index_stats(indexed[SCALAR_INDEXES[0][0]]))
            else:
                self._ensure_scalar_indexes(indexed)
        return False

    def _fold_if_due(self, stats: IndexStatistics | None) -> None:
        """``optimize`` once the index these ``stats`` describe has ``cfg.index_fold_rows`` unindexed rows."""
        if stats is not None and stats.num_unindexed_rows >= self.cfg.index_fold_rows:
            self.optimize()

    def index_plan(self, rows: int | None = None) -> IndexPlan:
        """The index (type and sizes) a build now (or at ``rows`` rows) gets; see index_plan.py."""
        return plan_index(self.dim, self.count() if rows is None else rows, self.cfg)

    def index_type(self) -> str | None:
        """The type of the vector index on the table ("IVF_HNSW_SQ", "IVF_PQ"; None: no index)."""
        name = self._indexed_columns().get(VECTOR)
        stats = self._table.index_stats(name) if name else None
        return stats.index_type if stats is not None else None

    def rebuild_index(self) -> None:
        """Rebuild the vector index from scratch (after changing store.metric, its type or sizes)."""
        rows = self.count()
        if rows < IVF_MIN_ROWS:
            raise ValueError(f"an IVF index needs >= {IVF_MIN_ROWS} rows, the table has {rows}")
        self._build_vector_index(rows)

    def _build_vector_index(self, rows: int) -> None:
        self._writable()
        plan = self.index_plan(rows)
        self._table.create_index(VECTOR, config=plan.index_config(self.cfg.metric), replace=True)
        self._table.update_field_metadata({"path": VECTOR, "metadata": {INDEX_ROWS_KEY: str(rows)}})

    def _index_rows(self) -> int | None:
        """Rows the vector index was last built on (None: no index, or built before we recorded it)."""
        value = (self._table.schema.field(VECTOR).metadata or {}).get(INDEX_ROWS_KEY.encode())
        return int(value) if value and self.has_index() else None

    def _ensure_scalar_indexes(self, indexed: dict[str, str]) -> None:
        for column, kind in SCALAR_INDEXES:
            if column not in indexed:
                self._writable()
                self._table.create_index(column, config=kind())

    # ------------------------------------------------------------------ upkeep

    def optimize(self) -> int:
        """Compact small files, fold unindexed rows into the indexes and prune old versions;
        returns the new version.

        Prunes versions older than ``cfg.retain_versions_days`` except what lineage points at:
        tagged versions (``tag``) are kept, and since LanceDB refuses to prune a tagged version,
        pruning stops short of the oldest tag (``untag`` the ones no run needs any more).
        """
        self._writable()
        self._table.optimize(cleanup_older_than=datetime.now() - self._prune_before())
        return self.version

    def _prune_before(self) -> datetime:
        """The cutoff: versions created before it may be deleted."""
        cutoff = datetime.now() - timedelta(days=self.cfg.retain_versions_days)
        tagged = set(self.tags().values())
        if tagged:
            stamps = {int(v["version"]): v["timestamp"] for v in self._table.list_versions()}
            oldest = min(stamps[v] for v in tagged if v in stamps)
            cutoff = min(cutoff, oldest - TAG_PRUNE_MARGIN)
        return cutoff

    def upkeep(self) -> UpkeepReport:
        """The scheduled maintenance: build the index if due, or retrain it once the table grew
        ``cfg.index_rebuild_growth``× since its last build (partitions sized for the rows of
        today) or when it is not of ``cfg.index_type`` (a store indexed before the type
        changed); then compact, fold and prune (``optimize``). Safe to run at any time."""
        self._writable()
        before = (self.version, self._version_count(), self.disk_bytes(), self._fragments())
        built = rebuilt = False
        if not self.has_index():
            built = self.ensure_index()
        else:
            index_rows = self._index_rows()
            rows = self.count()
            grown = index_rows is None or rows >= self.cfg.index_rebuild_growth * index_rows
            if grown or self.index_type() != self.cfg.index_type:
                self.rebuild_index()
                rebuilt = True
        pruned_before = self._prune_before()
        self.optimize()
        return UpkeepReport(
            version_before=before[0], version_after=self.version,
            versions_before=before[1], versions_after=self._version_count(),
            bytes_before=before[2], bytes_after=self.disk_bytes(),
            fragments_before=before[3], fragments_after=self._fragments(),
            index_built=built, index_rebuilt=rebuilt, indexed=self.has_index(), pruned_before=pruned_before,
            tags=self.tags(),
        )

    def disk_bytes(self) -> int:
        """Bytes of the table's directory or prefix: every version's data, indexes and manifests."""
        return table_bytes(self.location, self.cfg.table)

    def _version_count(self) -> int:
        return len(self._table.list_versions())

    def _fragments(self) -> int:
        return int(self._table.stats()["fragment_stats"]["num_fragments"])

    # ------------------------------------------------------------------ reads

    def search(
        self,
        vectors: np.ndarray,
        k: int,
        success: bool | None = None,
        task: str | None = None,
        robot_id: str | None = None,
        exclude_episode_ids: Iterable[str] = (),
        exact: bool = False,
    ) -> SearchResult:
        """k nearest segments for each row of ``vectors`` (Q, D), filtered before ranking.

        At least ``store.scan_min_queries`` queries: one exact streaming pass over the table for
        all of them (``scan.py``; many queries amortise the read). Fewer: the resident index
        (``resident()``: a FAISS copy of this version in memory) when ``store.resident_index`` is
        on, else LanceDB, through its index once built (``exact=True``: LanceDB flat),
        ``store.search_batch_queries`` queries per call (memory stays bounded; the result does not
        depend on the batch size).
        """
        queries = np.asarray(vectors, dtype=np.float32)
        if queries.ndim == 1:
            queries = queries[None]
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(
                f"search vectors must be (Q, {self.dim}) to match column 'vector', got "
                f"{np.shape(vectors)}; encode windows with the store's encoder"
            )
        if k < 1:
            raise ValueError(f"search k must be >= 1, got {k}")
        if not np.isfinite(queries).all():
            raise ValueError("search vectors contain NaN/inf")
        n_queries = queries.shape[0]
        few = 0 < n_queries < self.cfg.scan_min_queries
        resident = self._current_resident() if few and not exact else None
        if resident is not None:
            return resident.search(queries, k, success, task, robot_id, exclude_episode_ids)
        version = self.version
        if n_queries == 0:
            return _empty_result(n_queries, k, self.cfg.metric, version)
        filters = self._filters(success, task, robot_id, exclude_episode_ids)
        if n_queries >= self.cfg.scan_min_queries:
            if self.count() == 0:
                return _empty_result(n_queries, k, self.cfg.metric, version)
            return self._scan(queries, k, filters, version)
        batch = self.cfg.search_batch_queries
        parts = [self._search_batch(queries[i : i + batch], k, filters, exact, version)
                 for i in range(0, n_queries, batch)]
        return parts[0] if len(parts) == 1 else _concat_results(parts)

    def resident(self, version: int | None = None) -> ResidentIndex | None:
        """The resident index of ``version`` (default: the current one), built on first use and
        rebuilt once the table has moved past it (one read of the table, read at that version).
        None when ``store.resident_index`` is off or the table holds more than
        ``store.resident_max_rows`` rows (LanceDB's index answers then)."""
        if not self.cfg.resident_index:
            return None
        version = self.version if version is None else version
        if self._resident is not None and self._resident[0] == version:
            return self._resident[1]
        view = self.checkout(version)
        if view.count() > self.cfg.resident_max_rows:
            self._resident = (version, None)
            return None
        from components.store.resident import FILTER_COLUMNS, ResidentIndex

        batches = view._row_batches([VECTOR, *RESULT_COLUMNS, *FILTER_COLUMNS])
        self._resident = (version, ResidentIndex.build(batches, version, self.dim, self.cfg))
        return self._resident[1]

    def _current_resident(self) -> ResidentIndex | None:
        """``resident()``, comparing the table's version at most every ``store.resident_check_s``
        (and after this handle's own writes): the version check is a LanceDB round trip whose
        wake-up of LanceDB's threads cost more than the FAISS search itself on 2 cores."""
        if self._resident is not None and (
            self.read_only or time.monotonic() - self._resident_checked < self.cfg.resident_check_s
        ):
            return self._resident[1]
        self._resident_checked = time.monotonic()
        return self.resident()

    @staticmethod
    def _filters(success: bool | None, task: str | None, robot_id: str | None,
                 exclude_episode_ids: Iterable[str]) -> list[str]:
        filters = []
        if success is not None:
            filters.append(f"success = {'true' if success else 'false'}")
        if task is not None:
            filters.append(f"task = {_sql_str(task)}")
        if robot_id is not None:
            filters.append(f"robot_id = {_sql_str(robot_id)}")
        excluded = sorted(set(exclude_episode_ids))
        if excluded:
            filters.append(f"NOT ({_sql_in('episode_id', excluded)})")
        return filters

    def _scan(self, queries: np.ndarray, k: int, filters: list[str], version: int) -> SearchResult:
        """Exact answer in one pass over the (filtered) table: see components/store/scan.py."""
        batches = self._row_batches([VECTOR, *RESULT_COLUMNS], filters)
        hits, rows = scan_nearest(batches, VECTOR, queries, k, self.cfg.metric,
                                  self.cfg.scan_query_block, keep=RESULT_COLUMNS)
        result = _empty_result(queries.shape[0], k, self.cfg.metric, version)
        found = hits.positions >= 0
        if rows is None or not found.any():
            return result
        q, r = np.nonzero(found)
        _place(result, q, r, rows.take(pa.array(hits.positions[q, r])), hits.distances[q, r])
        result.counts[:] = found.sum(axis=1)
        return result

    def _row_batches(self, columns: list[str], filters: Sequence[str] = ()) -> Iterator[pa.RecordBatch]:
        """The table's (filtered) rows, ``columns`` only, streamed ``store.scan_rows`` at a time."""
        scan = self._table.search().select(columns).limit(None)
        if filters:
            scan = scan.where(" AND ".join(filters))
        return scan.to_batches(self.cfg.scan_rows)

    def _search_batch(self, queries: np.ndarray, k: int, filters: list[str], exact: bool, version: int) -> SearchResult:
        n_queries = queries.shape[0]
        # LanceQueryBuilder.create, not table.search: the latter reads the schema (a round trip)
        # to find the vector column, which we name
        query = (
            LanceQueryBuilder.create(
                self._table, list(queries) if n_queries > 1 else queries[0], "vector", vector_column_name=VECTOR
            )
            .distance_type(self.cfg.metric)
            .select([*RESULT_COLUMNS, "_distance"])
            .limit(k)
        )
        if filters:
            query = query.where(" AND ".join(filters), prefilter=True)
        if exact:
            query = query.bypass_vector_index()
        else:
            params = search_params(self._index_type_at(version), k, self.cfg)
            query = query.nprobes(params.nprobes)
            if params.ef is not None:
                query = query.ef(params.ef)
            if params.refine_factor:
                query = query.refine_factor(params.refine_factor)
        return _to_result(query.to_arrow(), n_queries, k, self.cfg.metric, version)

    def _index_type_at(self, version: int) -> str | None:
        """``index_type()``, looked up once per table version (an index changes only with one)."""
        if self._index_type_seen is None or self._index_type_seen[0] != version:
            self._index_type_seen = (version, self.index_type())
        return self._index_type_seen[1]


# ---------------------------------------------------------------------- helpers


def _connect(location: StoreLocation, strong: bool = True) -> lancedb.DBConnection:
    """``strong``: every call looks for the latest version; else only an explicit
    ``checkout_latest`` does (a "step" handle's writes)."""
    return lancedb.connect(location.uri, read_consistency_interval=timedelta(0) if strong else None,
                           storage_options=location.storage_options)


def table_exists(location: StoreLocation, table: str) -> bool:
    """Whether the store holds ``table`` (a local folder is looked at without opening LanceDB)."""
    folder = location.local_path
    if folder is not None:
        return (folder / f"{table}.lance").exists()
    try:
        _connect(location).open_table(table)  # LanceDB's table_exists is not implemented for object stores
    except (FileNotFoundError, ValueError):  # "Table '...' was not found", as _open_or_create reads it
        return False
    except (OSError, RuntimeError) as exc:
        raise location.unreachable(exc) from None
    return True


def _open_or_create(location: StoreLocation, table: str, dim: int, strong: bool = True) -> lancedb.table.Table:
    db = _connect(location, strong)
    try:
        return db.open_table(table)
    except (FileNotFoundError, ValueError):
        return db.create_table(table, schema=segment_schema(dim), exist_ok=True)


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


def _empty_result(n_queries: int, k: int, metric: str, version: int) -> SearchResult:
    return SearchResult(
        segment_ids=np.full((n_queries, k), "", dtype=object),
        episode_ids=np.full((n_queries, k), "", dtype=object),
        robot_ids=np.full((n_queries, k), "", dtype=object),
        starts=np.full((n_queries, k), -1, dtype=np.int64),
        ends=np.full((n_queries, k), -1, dtype=np.int64),
        success=np.zeros((n_queries, k), dtype=bool),
        distances=np.full((n_queries, k), np.inf, dtype=np.float32),
        counts=np.zeros(n_queries, dtype=np.int64),
        metric=metric,
        version=version,
    )


def _concat_results(parts: list[SearchResult]) -> SearchResult:
    """Batches of one search, stacked in query order."""
    def stack(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts], axis=0)

    return SearchResult(
        segment_ids=stack("segment_ids"), episode_ids=stack("episode_ids"), robot_ids=stack("robot_ids"),
        starts=stack("starts"), ends=stack("ends"), success=stack("success"), distances=stack("distances"),
        counts=stack("counts"), metric=parts[0].metric, version=parts[0].version,
    )


def _to_result(hits: pa.Table, n_queries: int, k: int, metric: str, version: int) -> SearchResult:
    result = _empty_result(n_queries, k, metric, version)
    if hits.num_rows == 0:
        return result
    if "query_index" in hits.column_names:
        query = hits.column("query_index").to_numpy().astype(np.int64)
    else:
        query = np.zeros(hits.num_rows, dtype=np.int64)
    distance = hits.column("_distance").to_numpy().astype(np.float32)
    order = np.lexsort((distance, query))
    query, distance = query[order], distance[order]
    counts = np.bincount(query, minlength=n_queries)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(len(query)) - first[query]
    keep = rank < k
    q, r, o = query[keep], rank[keep], order[keep]
    _place(result, q, r, hits.take(pa.array(o)), distance[keep])
    result.counts[:] = np.minimum(counts, k)
    return result


def _place(result: SearchResult, q: np.ndarray, r: np.ndarray, rows: pa.Table, distances: np.ndarray) -> None:
    """Write hit ``i`` (``rows`` row i, ``distances[i]``) into ``result`` at query q[i], rank r[i]."""
    result.distances[q, r] = distances
    for name, target in (("segment_id", result.segment_ids), ("episode_id", result.episode_ids),
                         ("robot_id", result.robot_ids)):
        target[q, r] = np.asarray(rows.column(name).to_pylist(), dtype=object)
    result.starts[q, r] = rows.column("start").to_numpy()
    result.ends[q, r] = rows.column("end").to_numpy()
    result.success[q, r] = rows.column("success").to_numpy(zero_copy_only=False)
