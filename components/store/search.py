"""The store's reads: k nearest segments per query, filtered before ranking, from the engine
that answers that many queries best (resident FAISS copy, LanceDB, or one exact scan).

Every call on a LanceDB table (version, count, schema, query) is one round trip to LanceDB's
background event loop, which a loaded host makes cost milliseconds, so the single-query path
makes as few as it can.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
from lancedb.query import LanceQueryBuilder

from components.store.index_plan import search_params
from components.store.resident import FILTER_COLUMNS, ResidentIndex
from components.store.scan import scan_nearest
from components.store.schema import RESULT_COLUMNS, VECTOR, sql_in, sql_str
from components.store.search_result import SearchResult, concat_results, empty_result, place, to_result


class SegmentSearch:
    """``search`` and the resident index it answers few queries from.

    Part of ``SegmentStore`` (segment_store.py), whose handle holds ``_table``, ``cfg``, ``dim``,
    ``location``, ``read_only`` and ``consistency``.
    """

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
            return empty_result(n_queries, k, self.cfg.metric, version)
        filters = self._filters(success, task, robot_id, exclude_episode_ids)
        if n_queries >= self.cfg.scan_min_queries:
            if self.count() == 0:
                return empty_result(n_queries, k, self.cfg.metric, version)
            return self._scan(queries, k, filters, version)
        batch = self.cfg.search_batch_queries
        parts = [self._search_batch(queries[i : i + batch], k, filters, exact, version)
                 for i in range(0, n_queries, batch)]
        return parts[0] if len(parts) == 1 else concat_results(parts)

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
            filters.append(f"task = {sql_str(task)}")
        if robot_id is not None:
            filters.append(f"robot_id = {sql_str(robot_id)}")
        excluded = sorted(set(exclude_episode_ids))
        if excluded:
            filters.append(f"NOT ({sql_in('episode_id', excluded)})")
        return filters

    def _scan(self, queries: np.ndarray, k: int, filters: list[str], version: int) -> SearchResult:
        """Exact answer in one pass over the (filtered) table: see components/store/scan.py."""
        batches = self._row_batches([VECTOR, *RESULT_COLUMNS], filters)
        hits, rows = scan_nearest(batches, VECTOR, queries, k, self.cfg.metric,
                                  self.cfg.scan_query_block, keep=RESULT_COLUMNS)
        result = empty_result(queries.shape[0], k, self.cfg.metric, version)
        found = hits.positions >= 0
        if rows is None or not found.any():
            return result
        q, r = np.nonzero(found)
        place(result, q, r, rows.take(pa.array(hits.positions[q, r])), hits.distances[q, r])
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
        return to_result(query.to_arrow(), n_queries, k, self.cfg.metric, version)

    def _index_type_at(self, version: int) -> str | None:
        """``index_type()``, looked up once per table version (an index changes only with one)."""
        if self._index_type_seen is None or self._index_type_seen[0] != version:
            self._index_type_seen = (version, self.index_type())
        return self._index_type_seen[1]
