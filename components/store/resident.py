"""The segment table held in process memory under a FAISS index, for single-query latency.

    one table version, read once (vector + result columns + task)
      --FAISS: exact flat index below store.index_min_rows rows, else IVF (rows / resident_list_rows
        lists, k-means on a seeded sample), over float32 or 8-bit scalar-quantized vectors-->
    ResidentIndex.search(queries, k, success, task, robot_id, exclude_episode_ids)
      --filters as a row bitmap (cached per filter), probed lists scaled up when a filter keeps
        few rows-->  SearchResult, same shape as SegmentStore.search's

Why in memory: a LanceDB query through its Python API costs ~5 ms at the median and ~12 ms at
p99 on this 2-core host **on a 100-row table** (planning, version check, Arrow hand-off), so no
LanceDB index setting reaches a 5-ms p99 at 1M segments (docs/results.md, kNN). A FAISS IVF
list scan of the same 1M segments answers in about a millisecond. LanceDB stays the store of
record: the resident index is a read-only copy of one version, rebuilt when the table moves
(``SegmentStore.search`` does it when ``store.resident_index`` is on), and each result names the
version it read.

Filters: a query keeps only rows whose bitmap bit is set (FAISS skips the rest while scanning its
lists). A filter that keeps a fraction f of the rows would leave an IVF probe of ``nprobe`` lists
with f of its candidates, so the probe widens to ``nprobe / f`` lists (at most all of them: an
exact filtered scan), which keeps recall level across filters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from components.config import StoreConfig
from components.store.scan import vectors_of
from components.store.schema import RESULT_COLUMNS, VECTOR, segment_schema
from components.store.search_result import SearchResult, empty_result, place

FILTER_COLUMNS = ("task",)
TRAIN_SAMPLE_PER_LIST = 64  # k-means sample: rows per IVF list (FAISS warns below 39)


@dataclass
class ResidentIndex:
    """A FAISS index over one version of the segment table, with its result and filter columns."""

    version: int
    index: faiss.Index
    rows: pa.Table  # RESULT_COLUMNS, row i = FAISS id i
    success: np.ndarray  # (N,) bool
    task_codes: np.ndarray  # (N,) int32 into tasks
    tasks: dict[str, int]
    robot_codes: np.ndarray  # (N,) int32 into robots
    robots: dict[str, int]
    episode_codes: np.ndarray  # (N,) int32 into episodes
    episodes: dict[str, int]
    metric: str
    nprobe: int
    build_s: float
    _bitmaps: dict[tuple, tuple[np.ndarray, int]] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return self.rows.num_rows

    @property
    def kind(self) -> str:
        return "flat" if isinstance(self.index, faiss.IndexFlat) else "ivf"

    @property
    def nbytes(self) -> int:
        """Memory held: the FAISS index (vectors and lists) plus the columns."""
        arrays = (self.success, self.task_codes, self.robot_codes, self.episode_codes)
        return int(faiss.serialize_index(self.index).nbytes + self.rows.nbytes + sum(a.nbytes for a in arrays))

    # ------------------------------------------------------------------ build

    @classmethod
    def build(cls, batches: Iterable[pa.RecordBatch], version: int, dim: int, cfg: StoreConfig,
              seed: int = 0) -> ResidentIndex:
        """Read ``batches`` (the table at ``version``: VECTOR, RESULT_COLUMNS, ``task``) and index
        them; IVF k-means is seeded by ``seed`` so the same table gives the same index."""
        t0 = time.perf_counter()
        columns = [*RESULT_COLUMNS, *FILTER_COLUMNS]
        parts, kept = [], []
        for batch in batches:
            if batch.num_rows:
                parts.append(vectors_of(batch.column(VECTOR), dim))
                kept.append(batch.select(columns))
        # a fresh float32 array (FAISS normalizes cosine vectors in place)
        vectors = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros((0, dim), np.float32)
        del parts
        if cfg.metric == "cosine":
            faiss.normalize_L2(vectors)
        table = pa.Table.from_batches(kept) if kept else segment_schema(dim).empty_table().select(columns)
        index = _make_index(vectors, dim, cfg, seed)
        task_codes, tasks = _codes(table.column("task"))
        robot_codes, robots = _codes(table.column("robot_id"))
        episode_codes, episodes = _codes(table.column("episode_id"))
        # one chunk: a take() from a table of many scanned batches cost ~1 ms per query
        return cls(version=version, index=index, rows=table.select(list(RESULT_COLUMNS)).combine_chunks(),
                   success=table.column("success").to_numpy(zero_copy_only=False).astype(bool),
                   task_codes=task_codes, tasks=tasks, robot_codes=robot_codes, robots=robots,
                   episode_codes=episode_codes, episodes=episodes, metric=cfg.metric,
                   nprobe=cfg.resident_nprobe, build_s=time.perf_counter() - t0)

    # ------------------------------------------------------------------ search

    def search(self, queries: np.ndarray, k: int, success: bool | None = None, task: str | None = None,
               robot_id: str | None = None, exclude_episode_ids: Iterable[str] = ()) -> SearchResult:
        """k nearest rows per query among those passing the filters."""
        q = np.array(queries, dtype=np.float32, order="C")  # a copy: cosine normalizes it in place
        if self.metric == "cosine":
            faiss.normalize_L2(q)
        result = empty_result(q.shape[0], k, self.metric, self.version)
        bits, kept = self._bitmap(success, task, robot_id, tuple(sorted(set(exclude_episode_ids))))
        if kept == 0 or len(self) == 0:
            return result
        distances, ids = self.index.search(q, k, params=self._params(bits, kept))
        if self.metric == "cosine":
            distances = 1.0 - distances  # inner product of unit vectors -> LanceDB's cosine distance
        found = ids >= 0
        if found.any():
            qi, ri = np.nonzero(found)
            place(result, qi, ri, self.rows.take(pa.array(ids[qi, ri])), distances[qi, ri].astype(np.float32))
        result.counts[:] = found.sum(axis=1)
        return result

    def _params(self, bits: np.ndarray | None, kept: int) -> faiss.SearchParameters:
        selector = None if bits is None else faiss.IDSelectorBitmap(len(self), faiss.swig_ptr(bits))
        if self.kind == "flat":
            return faiss.SearchParameters(sel=selector)
        nlist = self.index.nlist
        nprobe = min(nlist, math.ceil(self.nprobe * len(self) / kept))
        return faiss.SearchParametersIVF(nprobe=nprobe, sel=selector)

    def _bitmap(self, success: bool | None, task: str | None, robot_id: str | None,
                excluded: tuple[str, ...]) -> tuple[np.ndarray | None, int]:
        """The rows a filter keeps, as FAISS's little-endian bitmap (None: every row) and their count."""
        key = (success, task, robot_id, excluded)
        if key in self._bitmaps:
            return self._bitmaps[key]
        if key == (None, None, None, ()):
            return None, len(self)
        mask = np.ones(len(self), dtype=bool)
        if success is not None:
            mask &= self.success == success
        for value, codes, names in ((task, self.task_codes, self.tasks), (robot_id, self.robot_codes, self.robots)):
            if value is not None:
                mask &= codes == names.get(value, -1)
        if excluded:
            gone = [self.episodes[e] for e in excluded if e in self.episodes]
            if gone:
                mask &= ~np.isin(self.episode_codes, gone)
        entry = (np.packbits(mask, bitorder="little"), int(mask.sum()))
        if not excluded:  # exclusion lists vary per call; the others repeat
            self._bitmaps[key] = entry
        return entry


def _make_index(vectors: np.ndarray, dim: int, cfg: StoreConfig, seed: int) -> faiss.Index:
    """Exact flat below ``store.index_min_rows`` (as LanceDB searches an unindexed table); IVF above."""
    n = vectors.shape[0]
    inner = cfg.metric == "cosine"
    metric = faiss.METRIC_INNER_PRODUCT if inner else faiss.METRIC_L2
    if n < cfg.index_min_rows:
        index = faiss.IndexFlatIP(dim) if inner else faiss.IndexFlatL2(dim)
        index.add(vectors)
        return index
    nlist = max(1, n // cfg.resident_list_rows)
    index = faiss.index_factory(dim, f"IVF{nlist},{cfg.resident_encoding}", metric)
    sample = np.random.default_rng(seed).choice(n, min(n, nlist * TRAIN_SAMPLE_PER_LIST), replace=False)
    index.cp.seed = seed
    index.train(vectors[np.sort(sample)])
    index.add(vectors)
    return index


def _codes(column: pa.ChunkedArray) -> tuple[np.ndarray, dict[str, int]]:
    """A string column as int32 codes and the name -> code map."""
    encoded = pc.dictionary_encode(column.combine_chunks())
    names = encoded.dictionary.to_pylist()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32), {n: i for i, n in enumerate(names)}
