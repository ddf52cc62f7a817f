"""What the store's writes and upkeep report, and the embed cursor kept in the table's metadata."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


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

