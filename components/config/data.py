"""The data plane: the episode dataset (``episodes``, its ``video`` encoding) and the LanceDB
segment store (``store``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from components.config.base import Section


class VideoConfig(Section):
    """How camera streams are encoded on store (components/episodes/video.py): LeRobot's defaults
    (``VideoEncoderConfig``: AV1 by SVT-AV1, yuv420p, a keyframe every 2 frames, crf 30, preset 12)."""

    codec: Literal["libsvtav1", "h264"] = "libsvtav1"
    pix_fmt: Literal["yuv420p"] = "yuv420p"
    gop: int = Field(default=2, ge=1)  # keyframe interval (LeRobot's g): short = fast random access
    crf: int = Field(default=30, ge=0, le=63)
    preset: int = Field(default=12, ge=0, le=13)  # SVT-AV1 speed preset (13 fastest)
    # where an ingest encodes: "background" = a thread encodes while the data file, tasks and
    # stats are written, joined before the commit; "inline" = before them (benchmarks/vision.py)
    encode: Literal["inline", "background"] = "background"
    # SVT-AV1 can deadlock mid-encode (idle, never returning): each encode runs in a child process
    # (components/episodes/encoder_process.py) that is killed, and the encode retried, once it has
    # not answered in encode_timeout_s + frames / encode_min_fps seconds
    encode_timeout_s: float = Field(default=60.0, gt=0)
    encode_min_fps: float = Field(default=50.0, gt=0)
    encode_attempts: int = Field(default=3, ge=1)
    encoder_start_timeout_s: float = Field(default=120.0, gt=0)  # the child's imports, on a loaded machine


class EpisodesConfig(Section):
    """Episode dataset on disk (LeRobot v3 layout)."""

    chunk_size: int = 1000  # data files per chunk-XXX folder (LeRobot `chunks_size`)
    fps: float = 10.0  # written to info.json when a dataset is created
    codebase_version: str = "v3.0"
    robot_type: str = "fleetloop"  # info.json `robot_type`
    compression: Literal["snappy", "zstd", "gzip", "none"] = "snappy"  # Parquet codec
    # each ingest commits one episodes-table file; once the newest run of files under meta_file_mb
    # holds meta_merge_files of them, the ingest merges them into one (components/episodes/meta_files.py),
    # so a first open reads tens of files, not one per ingest (1,003 and 8 s at 10M frames)
    meta_merge_files: int = Field(default=64, ge=2)
    meta_file_mb: float = Field(default=16.0, gt=0)
    # ...and merges the data files of those episodes into files of up to data_file_mb (LeRobot's
    # data_files_size_in_mb), so a DVC snapshot walks tens of files, not one per ingest
    # (components/episodes/data_files.py); merged-away files stay readable this long for handles
    # opened before the merge
    data_file_mb: float = Field(default=100.0, gt=0)
    superseded_retain_hours: float = Field(default=24.0, ge=0)
    # every ingest pushes the dataset's DVC snapshot here ("" = the root's DVC cache only):
    # s3://bucket/prefix (keys from env: AWS_ACCESS_KEY_ID, ...) or a shared path
    dvc_remote: str = ""
    dvc_remote_endpoint: str = ""  # an S3-compatible server (MinIO, Ceph, ...); "" = AWS S3
    video: VideoConfig = VideoConfig()  # camera streams (components/episodes/video.py)


STORE_URI_SCHEMES = ("s3", "gs", "az")  # object stores LanceDB reaches (s3 is the one tested)


class StoreConfig(Section):
    """LanceDB segment store of window embeddings (see components/store/README.md)."""

    # where the store lives: "" = <root>/datasets/segments.lance; else s3://bucket/prefix (or an
    # absolute shared path). Endpoint, region and keys come from the environment only
    # (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), read by LanceDB itself
    uri: str = ""
    # an object store not answering is retried this long, then the store is down (one-line error);
    # LanceDB's own default retries a request for 3 minutes
    connect_timeout_s: float = Field(default=5.0, gt=0)
    retry_timeout_s: float = Field(default=10.0, gt=0)
    max_retries: int = Field(default=2, ge=0)
    table: str = "segments"
    window: int = Field(default=8, ge=1)  # frames per segment
    stride: int = Field(default=4, ge=1)  # frames between segment starts
    # IVF indexes train k-means on the rows present: below 256 IVF_PQ silently indexes nothing, so never lower.
    index_min_rows: int = Field(default=50_000, ge=256)
    # the vector index (components/store/index_plan.py). IVF_PQ: product-quantized partitions
    # (index_partitions, index_sub_vectors, nprobes, refine_factor); IVF_HNSW_SQ: IVF partitions,
    # each an HNSW graph over 8-bit scalar-quantized vectors (the hnsw_* keys): 1.7x less CPU per
    # unfiltered query at 1M, no gain with the success filter, 2x the build (docs/results.md). A
    # store whose index is of the other type is searched with that type's keys until upkeep rebuilds it.
    index_type: Literal["IVF_PQ", "IVF_HNSW_SQ"] = "IVF_PQ"
    # k-means iterations when an IVF index is trained (its partitions, and PQ's codebooks). LanceDB's
    # default 50 took 58 s of one ingest at the first build (74k rows) and 112 s at 1M rows; 10 took
    # 12 s and 37 s, recall@10 at 1M 0.999 -> 0.997 with the search keys below (docs/results.md)
    index_max_iterations: int = Field(default=10, ge=1)
    # --- IVF_PQ
    index_partitions: int = Field(default=256, ge=1)
    # preferred PQ sub-vectors; when it does not divide the vector dim (88 for the default sim)
    # the store takes a divisor giving 4-16 dims each, 22 for 88 (components/store/index_plan.py)
    index_sub_vectors: int = Field(default=16, ge=1)
    nprobes: int = Field(default=20, ge=1)  # IVF_PQ partitions searched per query
    refine_factor: int = Field(default=30, ge=0)  # re-rank k*factor PQ hits exactly; 0 = off
    # --- IVF_HNSW_SQ
    hnsw_partition_rows: int = Field(default=16_000, ge=256)  # partitions = rows / this
    hnsw_m: int = Field(default=16, ge=2)  # graph edges per node
    hnsw_ef_construction: int = Field(default=150, ge=1)  # build-time search breadth
    hnsw_nprobes: int = Field(default=10, ge=1)  # partitions searched per query
    hnsw_ef: int = Field(default=40, ge=1)  # per-partition search breadth (>= k is used)
    hnsw_refine_factor: int = Field(default=0, ge=0)  # re-rank k*factor SQ hits exactly; 0 = off
    metric: Literal["l2", "cosine"] = "l2"  # used to build the index AND to query it
    # --- resident index (components/store/resident.py): searches of fewer than scan_min_queries
    # queries answered from a FAISS copy of the table in memory, rebuilt when the table moves.
    # LanceDB's own query costs ~5 ms p50 / 12 ms p99 even on a 100-row table (docs/results.md)
    resident_index: bool = True
    resident_list_rows: int = Field(default=1_000, ge=1)  # IVF lists = rows / this (flat below index_min_rows)
    resident_nprobe: int = Field(default=32, ge=1)  # lists probed per query (more when a filter keeps few rows)
    resident_encoding: Literal["Flat", "SQ8"] = "Flat"  # float32 (4 B/dim) or 8-bit (1 B/dim) vectors
    # a larger table stays on LanceDB's index: Flat holds 4 x dim bytes per row (352 B at 88 dims)
    resident_max_rows: int = Field(default=5_000_000, ge=0)
    # LanceDB's vector index is built (by ingest's index upkeep) once the table has this many rows;
    # unset: index_min_rows. With the resident index on, LanceDB's index answers single queries
    # only above resident_max_rows, so a larger value skips an early build (11-69 s of one ingest
    # in a fleet-scaling cell) - but without the index's folds the table's compactions rewrote far
    # more data: a 7-day-retention store grew ~2x faster on disk (docs/results.md), so not default.
    vector_index_min_rows: int | None = Field(default=None, ge=256)
    # other processes' writes reach single queries within this many seconds (this handle's own at once)
    resident_check_s: float = Field(default=1.0, ge=0)
    # queries per LanceDB call: an indexed search materialises k * refine_factor rows per query,
    # so FERT's tens of thousands of failure windows in one call took >15 GB (96-robot study)
    search_batch_queries: int = Field(default=1024, ge=1)
    # a search of at least scan_min_queries queries (FERT's divergence and retrieval) is answered
    # exactly by one streaming pass over the table (components/store/scan.py): at 336k segments,
    # 1,164 prefiltered queries took 85 s through the index, 23 s flat in LanceDB, 21 s scanned
    scan_min_queries: int = Field(default=64, ge=1)
    scan_rows: int = Field(default=32_768, ge=1)  # rows per streamed batch
    scan_query_block: int = Field(default=1024, ge=1)  # queries scored together (block x rows floats)
    upsert_batch_rows: int = Field(default=100_000, ge=1)  # segments per merge_insert commit
    # ingest folds new rows into the vector index once this many are unindexed (searched flat till then)
    index_fold_rows: int = Field(default=50_000, ge=1)
    # upkeep retrains the vector index once the table has grown this much since its last build
    index_rebuild_growth: float = Field(default=2.0, gt=1.0)
    # upkeep/optimize prune versions older than this; tagged versions (lineage) are always kept
    # (0 keeps only the latest: only when no other process reads the table)
    retain_versions_days: float = Field(default=7, ge=0)
    # `fleetloop reproduce` needs the store version a model read: registration tags it model-v<N>
    # for the newest this-many train-task models and untags older ones (a tag stops pruning from
    # its version on, so keeping every model's would grow the store without bound)
    model_versions_kept: int = Field(default=10, ge=1)
    upkeep_cron: str = "30 3 * * *"  # when the store-upkeep flow runs once deployed (flows/upkeep.py)

    @field_validator("uri")
    @classmethod
    def _store_uri(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if value and not Path(value).is_absolute() and scheme not in STORE_URI_SCHEMES:
            raise ValueError(f"store.uri {value!r}: expected \"\" (the local store under the root), an absolute "
                             f"path or {' / '.join(f'{s}://bucket/prefix' for s in STORE_URI_SCHEMES)}")
        return value

    @model_validator(mode="after")
    def _vector_index_before_handoff(self) -> StoreConfig:
        rows = self.vector_index_min_rows
        if self.resident_index and 0 < self.resident_max_rows < (rows or 0):
            raise ValueError(
                f"store.vector_index_min_rows={rows:,} is above store.resident_max_rows={self.resident_max_rows:,}: "
                "between the two, single queries would find neither the resident copy nor LanceDB's index and "
                "scan the table; lower store.vector_index_min_rows or leave it unset (index_min_rows)")
        return self

    @property
    def vector_index_rows(self) -> int:
        """Rows from which LanceDB's vector index is built (``vector_index_min_rows``, or its default)."""
        return self.index_min_rows if self.vector_index_min_rows is None else self.vector_index_min_rows
