"""The segment store: one LanceDB table of window embeddings, one row per segment.

Row contract (DESIGN.md): ``segment_id`` = f"{episode_id}:{start}", ``episode_id``,
``robot_id``, ``task``, ``start``, ``end`` (exclusive frame), ``success``, ``vector``
(fixed_size_list<float32>[dim]), ``policy_version``, ``snapshot``.

The handle is cut by job: the row contract in schema.py, writes in writes.py (idempotent
upserts under one writer), reads in search.py, indexes and pruning in upkeep.py; this module
opens the table and keeps lineage (tags, checkout), the embed cursor and the encoder's record.

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
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import lancedb

from components.config import StoreConfig
from components.store.encoder import WindowEncoder, encoder_fingerprint, encoder_from_state_dict
from components.store.location import StoreLocation
from components.store.reports import EmbedCursor, UpkeepReport, UpsertReport
from components.store.resident import ResidentIndex
from components.store.schema import (
    EMBED_CURSOR_KEY,
    ENCODER_FINGERPRINT_KEY,
    ENCODER_STATE_KEY,
    ENCODER_STATE_MAX_BYTES,
    VECTOR,
    segment_schema,
)
from components.store.search import SegmentSearch
from components.store.search_result import SearchResult
from components.store.table import connect, open_or_create, table_exists
from components.store.upkeep import SegmentUpkeep
from components.store.writes import SegmentWrites

# the public names callers import from here (the store's split modules hold them)
__all__ = [
    "Consistency", "EMBED_CURSOR_KEY", "EmbedCursor", "SearchResult", "SegmentStore", "UpkeepReport",
    "UpsertReport", "VECTOR", "segment_schema", "table_exists",
]

Consistency = Literal["strong", "step"]  # SegmentStore.open


class SegmentStore(SegmentWrites, SegmentSearch, SegmentUpkeep):
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
            table = open_or_create(location, cfg.table, dim, strong=consistency == "strong")
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
        table = connect(self.location).open_table(self.cfg.table)
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
