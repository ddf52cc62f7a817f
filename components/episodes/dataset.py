"""The episode dataset on disk, in the LeRobot v3 layout, plus our episode-level columns.

```
root/
  meta/info.json                              features, fps, totals, path templates
  meta/episodes/chunk-XXX/file-XXX.parquet    one row per episode; one new file per ingest (its commit point;
                                              the newest small ones are merged: meta_files.py)
  meta/tasks.parquet                          task string <-> task_index
  meta/stats.json                             per-feature min/max/mean/std/count
  data/chunk-XXX/file-XXX.parquet             frames; one new file per ingest that adds episodes
  videos/<key>/chunk-XXX/file-XXX.mp4         camera streams: encoded on ingest (video.py), several
                                              episodes per file, or carried whole from LeRobot imports
```

Writes are ordered so a crash loses nothing already stored: new data/video files first (new
names, temp + ``os.replace``), then tasks, info and stats, and last the ingest's own episodes-table
file (meta_files.py), whose appearance is the single commit point. Files not referenced by the
episodes table are invisible and simply overwritten by the next ingest; totals and stats are
re-derived from the episodes table on open if they disagree with it. One writer at a time (an
``flock`` on ``root/.fleetloop.lock``). Every write costs what the batch costs: only the new
episodes' rows are written, stats.json is pooled from the last one plus the batch, and a process
rereads only the episodes-table files it has not seen.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import re
from collections.abc import Iterator, Set
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from components.config import EpisodesConfig
from components.episodes.data_files import (
    DATA_PATH,
    TMP_SUFFIX,
    describe,
    plan_data_merge,
    supersede,
    sweep,
    unreferenced,
    write_merged,
)
from components.episodes.incoming import (
    MISMATCH_FIX,
    DatasetMismatchError,
    EncodedCamera,
    IncomingEpisode,
    IngestReport,
    SourceLayout,
    StagedEpisode,
    read_incoming,
    schema_runs,
    stage_batch,
    stage_one,
)
from components.episodes.layout import (
    INFO_PATH,
    META_CONTENT_HASH,
    META_DATA_CHUNK,
    META_DATA_FILE,
    META_FROM,
    META_LENGTH,
    META_META_CHUNK,
    META_META_FILE,
    OWN_META_COLUMNS,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    copy_file,
    file_keys,
    infer_feature,
    is_location_column,
    new_info,
    next_file_number,
    next_video_numbers,
    pooled_stats,
    tasks_table,
    video_location_column,
    write_bytes,
    write_parquet,
)
from components.episodes.meta_files import (
    MetaFile,
    dedupe_episodes,
    list_meta_files,
    meta_file_path,
    next_meta_number,
    read_episodes_table,
    read_meta_file,
    tail_to_merge,
)
from components.episodes.quarantine import QuarantinedFile, quarantine_bytes, quarantine_file
from components.episodes.reader import DatasetReader
from components.episodes.record import Episode
from components.episodes.rows import (
    camera_hash,
    camera_location,
    data_table,
    meta_rows,
    with_int_column,
    with_stats,
)
from components.episodes.schema import (  # noqa: F401 - the bookkeeping names are re-exported
    ACTION,
    BOOKKEEPING_COLUMNS,
    CONTRACT_COLUMNS,
    EPISODE_ID,
    EPISODE_INDEX,
    FRAME_INDEX,
    INDEX,
    INTERRUPTED,
    POLICY_VERSION,
    ROBOT_ID,
    STATE,
    SUCCESS,
    TASK,
    TASK_INDEX,
    TIMESTAMP,
    episode_to_table,
    list_column_to_numpy,
    read_episode_file,
    table_to_episode,
    table_to_episodes,
)
from components.episodes.stats import stats_from_episodes_meta
from components.episodes.validation import (
    WHOLE_FILE,
    EpisodeValidationError,
    validate_episode_batch,
    validate_episode_table,
)
from components.episodes.encoder_process import encode_episodes
from components.episodes.video import video_feature, video_info
from components.episodes.video_validation import validate_camera_streams
from components.fsio import atomic_path

LOCK_NAME = ".fleetloop.lock"
FPS_TOLERANCE = 1e-6  # fps are compared as floats (info.json may hold 30 or 30.0)


class EpisodeDataset(DatasetReader):
    """Episodes stored in the LeRobot v3 layout under ``root``; ingest is validated and idempotent.
    Reading is ``DatasetReader``'s (reader.py); this class adds the one writer."""

    def __init__(self, root: Path, cfg: EpisodesConfig) -> None:
        super().__init__(root, cfg)
        self._encodings: list[Future] = []  # background video encodes of the ingest under way

    # ---------------------------------------------------------------- writing

    def _derived_meta_stale(self) -> bool:
        """True after a crash between the commit point and the info/stats rewrite."""
        return (
            self._meta is not None
            and self._info is not None
            and (
                self._info.get("total_episodes") != self._meta.num_rows
                or self._info.get("total_frames") != self.num_frames
            )
        )

    # ---------------------------------------------------------------- ingest

    @contextmanager
    def _writer(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_NAME, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._load()  # another writer may have committed since we last looked
                if self._derived_meta_stale():
                    self._write_derived_meta()
                yield
            finally:
                for encoding in self._encodings:  # an ingest that failed midway: no encoder outlives the lock
                    wait([encoding])
                self._encodings = []
                fcntl.flock(lock, fcntl.LOCK_UN)

    def ingest(
        self, paths: list[Path], known_robots: Set[str] | None, quarantine_dir: Path
    ) -> IngestReport:
        """Validate and store episode files (Parquet or Arrow IPC stream, one episode each).

        Bad files move to ``quarantine_dir`` with a reason file; the good ones of the batch are
        still stored. Episodes already stored with identical content are skipped.
        """
        incoming: list[IncomingEpisode] = []
        quarantined: list[QuarantinedFile] = []
        for path in map(Path, paths):
            item = read_incoming(path, quarantine_dir)
            (incoming if isinstance(item, IncomingEpisode) else quarantined).append(item)
        report = self.ingest_tables(incoming, known_robots, quarantine_dir)
        return dataclasses.replace(report, quarantined=tuple(quarantined) + report.quarantined)

    def add_episodes(
        self,
        episodes: list[Episode],
        known_robots: Set[str] | None = None,
        quarantine_dir: Path | None = None,
    ) -> IngestReport:
        """Store in-memory episodes, validated like files. Without ``quarantine_dir`` a bad
        episode raises ``EpisodeValidationError`` and nothing is stored."""
        incoming = []
        for ep in episodes:
            source = f"episode {ep.episode_id}"
            try:
                table = episode_to_table(ep)
            except (ValueError, pa.ArrowInvalid) as exc:
                raise EpisodeValidationError(
                    source, WHOLE_FILE, str(exc), "give states/actions as (frames, dim) float32 arrays"
                ) from exc
            incoming.append(IncomingEpisode(table=table, source=source, cameras=ep.cameras))
        return self.ingest_tables(incoming, known_robots, quarantine_dir)

    def ingest_tables(
        self,
        incoming: list[IncomingEpisode],
        known_robots: Set[str] | None,
        quarantine_dir: Path | None,
        layout: SourceLayout | None = None,
    ) -> IngestReport:
        """The one ingest path: validate, dedupe by episode_id + content, store in one new file.

        ``layout`` (imports): checked under the writer lock, so "empty" cannot change between
        the check and the store; raises ``DatasetMismatchError`` before anything is written.
        """
        with self._writer():
            base_info = self._adopt(layout)
            staged, quarantined = self._stage(incoming, known_robots, quarantine_dir, fresh=base_info is not None)
            stored = self._stored_hashes([item.episode.episode_id for item in staged])
            new: list[StagedEpisode] = []
            duplicates: list[str] = []
            for item in staged:
                episode_id = item.episode.episode_id
                known = stored.get(episode_id)
                if known is None:
                    stored[episode_id] = item.content_hash
                    new.append(item)
                elif known == item.content_hash:
                    duplicates.append(episode_id)
                else:
                    error = EpisodeValidationError(
                        item.incoming.source,
                        EPISODE_ID,
                        f"episode {episode_id} is already stored with different content",
                        "give a re-recorded or edited episode a new uuid4 episode_id",
                    )
                    quarantined.append(self._reject(item.incoming, error, quarantine_dir))
            if not new:
                return IngestReport(duplicates=tuple(duplicates), quarantined=tuple(quarantined))
            data_file = self._store(new, base_info)
            return IngestReport(
                added=tuple(s.episode.episode_id for s in new),
                duplicates=tuple(duplicates),
                quarantined=tuple(quarantined),
                frames_added=sum(s.episode.length for s in new),
                data_file=data_file,
            )

    def _adopt(self, layout: SourceLayout | None) -> dict[str, Any] | None:
        """The info.json an empty dataset starts from when ``layout`` is given (fps, robot type
        and state/action shapes of the source); for a non-empty one, None after checking that
        the layout matches what is stored."""
        if layout is None:
            return None
        if self.num_episodes == 0:  # a crashed first ingest may have left an info.json: start afresh
            return new_info(self.cfg, fps=layout.fps, robot_type=layout.robot_type)
        if abs(layout.fps - self.fps) > FPS_TOLERANCE:
            raise DatasetMismatchError(
                self.root, "fps", f"{self.fps:g}", f"{layout.fps:g}",
                MISMATCH_FIX.format(what="fps") + f", or resample the source to {self.fps:g} fps",
            )
        stored = {STATE: self.state_dim, ACTION: self.action_dim}
        for name, shape in sorted(layout.shapes.items()):
            ours = stored.get(name)
            if ours is not None and tuple(shape) != (ours,):
                raise DatasetMismatchError(
                    self.root, f"{name} shape", [ours], list(shape), MISMATCH_FIX.format(what=f"{name} shape"),
                )
        return None

    def _stage(
        self,
        incoming: list[IncomingEpisode],
        known_robots: Set[str] | None,
        quarantine_dir: Path | None,
        fresh: bool = False,
    ) -> tuple[list[StagedEpisode], list[QuarantinedFile]]:
        """Validate; ``fresh``: the batch starts a new info.json, so no stored shapes apply."""
        state_dim, action_dim = (None, None) if fresh else (self.state_dim, self.action_dim)
        staged: list[StagedEpisode] = []
        errors: list[tuple[IncomingEpisode, EpisodeValidationError]] = []
        tables = [i.table.drop_columns([c for c in BOOKKEEPING_COLUMNS if c in i.table.column_names]) for i in incoming]
        for run in schema_runs(tables):
            batch = validate_episode_batch([tables[i] for i in run], known_robots, state_dim, action_dim)
            if batch is not None:  # all of them pass: checked and canonicalised together
                staged.extend(stage_batch([incoming[i] for i in run], batch))
                state_dim, action_dim = batch.episodes[0].states.shape[1], batch.episodes[0].actions.shape[1]
                continue
            for i in run:  # one by one, so each rejection names its own file and field
                try:
                    episode = validate_episode_table(tables[i], known_robots, state_dim, action_dim, incoming[i].source)
                except EpisodeValidationError as error:
                    errors.append((incoming[i], error))
                    continue
                state_dim, action_dim = episode.states.shape[1], episode.actions.shape[1]
                staged.append(stage_one(incoming[i], episode, tables[i]))
        staged = self._with_cameras(staged, errors, fresh)
        if errors and quarantine_dir is None:
            raise errors[0][1]
        return staged, [self._reject(item, error, quarantine_dir) for item, error in errors]

    def _with_cameras(self, staged: list[StagedEpisode], errors: list[tuple[IncomingEpisode, EpisodeValidationError]],
                      fresh: bool) -> list[StagedEpisode]:
        """The staged episodes with their camera frames checked (video_validation.py) and in their
        content hash; those that fail join ``errors``. The dataset's resolution per camera is
        that of its info.json, else the batch's first episode with that camera."""
        resolutions = {} if fresh else {k: tuple(f["shape"][:2]) for k, f in self.features.items() if f.get("dtype") == "video"}
        kept: list[StagedEpisode] = []
        for item in staged:
            if not item.incoming.cameras:
                kept.append(item)
                continue
            try:
                frames = validate_camera_streams(item.incoming.cameras, item.episode, self.fps, resolutions, item.incoming.source)
            except EpisodeValidationError as error:
                errors.append((item.incoming, error))
                continue
            for key, images in frames.items():
                resolutions.setdefault(key, tuple(images.shape[1:3]))
            kept.append(dataclasses.replace(item, cameras=frames, content_hash=camera_hash(item.content_hash, frames)))
        return kept

    @staticmethod
    def _reject(
        item: IncomingEpisode, error: EpisodeValidationError, quarantine_dir: Path | None
    ) -> QuarantinedFile:
        if quarantine_dir is None:
            raise error
        if item.origin is not None:
            return quarantine_file(item.origin, error, quarantine_dir)
        sink = pa.BufferOutputStream()
        pq.write_table(item.table, sink)
        name = re.sub(r"[^A-Za-z0-9._-]", "_", item.source) + ".parquet"
        return quarantine_bytes(sink.getvalue().to_pybytes(), name, error, quarantine_dir)

    def _stored_hashes(self, episode_ids: list[str]) -> dict[str, str]:
        """Content hashes of those of ``episode_ids`` already stored (one vectorised lookup)."""
        if self._meta is None or not episode_ids:
            return {}
        wanted = pa.array(episode_ids, pa.string())
        mask = pc.is_in(self._meta.column(EPISODE_ID), value_set=wanted)
        found = self._meta.select([EPISODE_ID, META_CONTENT_HASH]).filter(mask)
        return dict(zip(found.column(EPISODE_ID).to_pylist(), found.column(META_CONTENT_HASH).to_pylist()))

    def _store(self, new: list[StagedEpisode], base_info: dict[str, Any] | None = None) -> Path:
        """Write one data file (+ copied videos), then tasks, info, stats, and commit the meta.
        ``base_info``: the info.json an empty dataset adopts from an import's source."""
        info = base_info or self._info or new_info(self.cfg)
        chunk_size = int(info["chunks_size"])
        data_chunk, data_file = divmod(next_file_number(self._meta, self.chunk_size), chunk_size)
        next_video = next_video_numbers(self._meta, self.chunk_size)
        encoding = self._start_encoding(new, next_video, chunk_size, float(info["fps"]))
        video_slots: dict[tuple[str, Path], tuple[int, int]] = {}
        tasks = list(self._tasks)
        task_of = {t: i for i, t in enumerate(tasks)}
        episode_index, frame_index = self.num_episodes, self.num_frames
        meta_number = next_meta_number(list_meta_files(self.root), chunk_size)
        meta_chunk, meta_file = divmod(meta_number, chunk_size)
        features = dict(info["features"])
        data_tables: list[pa.Table] = []
        extra_rows: list[dict[str, pa.Array]] = []  # carried meta and video locations, per episode
        for item in new:
            ep = item.episode
            if ep.task not in task_of:
                task_of[ep.task] = len(tasks)
                tasks.append(ep.task)
            data = data_table(item.table, episode_index, frame_index, task_of[ep.task])
            for name in data.column_names:
                if name not in features:
                    features[name] = dict(
                        item.incoming.features.get(name)
                        or infer_feature(data.schema.field(name).type, data.column(name)[0].as_py())
                    )
            extras: dict[str, pa.Array] = {}
            if item.incoming.meta_extra is not None:
                for name in item.incoming.meta_extra.column_names:
                    if name not in OWN_META_COLUMNS and not is_location_column(name):
                        extras[name] = item.incoming.meta_extra.column(name).combine_chunks()
            for key, src in sorted(item.incoming.videos.items()):
                slot = video_slots.get((key, Path(src)))
                if slot is None:
                    number = next_video.get(key, 0)
                    next_video[key] = number + 1
                    slot = divmod(number, chunk_size)
                    video_slots[(key, Path(src))] = slot
                    features.setdefault(key, dict(item.incoming.features.get(key) or {"dtype": "video"}))
                extras[video_location_column(key, "chunk_index")] = pa.array([slot[0]], pa.int64())
                extras[video_location_column(key, "file_index")] = pa.array([slot[1]], pa.int64())
            extra_rows.append(extras)
            data_tables.append(data)
            episode_index += 1
            frame_index += ep.length

        path = self.root / DATA_PATH.format(chunk_index=data_chunk, file_index=data_file)
        written = pa.concat_tables(data_tables, promote_options="permissive")
        write_parquet(path, written, self.cfg.compression)
        for (key, src), (chunk, number) in sorted(video_slots.items()):
            copy_file(src, self.root / VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=number))
        write_parquet(self.root / TASKS_PATH, tasks_table(tasks), self.cfg.compression)
        for key, encoded in encoding.result().items():  # the videos are written before the commit
            features[key] = encoded.feature
            for position, span in encoded.spans.items():
                extra_rows[position].update(camera_location(key, encoded.slot, span))
        lengths = [t.num_rows for t in data_tables]
        added = meta_rows(new, lengths, self.num_episodes, self.num_frames, (data_chunk, data_file),
                           (meta_chunk, meta_file), extra_rows)
        added = with_stats(added, written, lengths)
        previous = [self._meta] if self._meta is not None else []
        self._info = {**info, "features": features}
        if video_slots or any(item.cameras for item in new):
            self._info["video_path"] = VIDEO_PATH
        self._tasks = tasks
        self._meta = pa.concat_tables(previous + [added], promote_options="permissive")
        self._write_derived_meta(added)
        write_parquet(meta_file_path(self.root, meta_number, chunk_size), added, self.cfg.compression)  # commit
        self._merge_meta_tail()
        return path

    def _start_encoding(self, new: list[StagedEpisode], next_video: dict[str, int], chunk_size: int,
                        fps: float) -> Future[dict[str, EncodedCamera]]:
        """Encode the batch's camera streams, one new video file per camera key holding all its
        episodes (their numbers taken from ``next_video``). ``episodes.video.encode``:
        "background" encodes in a thread while the data file and tasks are written (the caller
        joins before the commit); "inline" encodes now."""
        keys = sorted({key for item in new for key in item.cameras})
        slots = {}
        for key in keys:
            slots[key] = divmod(next_video.get(key, 0), chunk_size)
            next_video[key] = next_video.get(key, 0) + 1

        def job() -> dict[str, EncodedCamera]:
            return {key: self._encode_camera(key, new, slots[key], chunk_size, fps) for key in keys}

        if not keys or self.cfg.video.encode == "inline":
            done: Future[dict[str, EncodedCamera]] = Future()
            done.set_result(job())
            return done
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video-encode")
        try:
            future = pool.submit(job)
            self._encodings.append(future)
            return future
        finally:
            pool.shutdown(wait=False)  # the one job runs on; its future is joined before the commit

    def _encode_camera(self, key: str, new: list[StagedEpisode], slot: tuple[int, int], chunk_size: int,
                       fps: float) -> EncodedCamera:
        positions = [i for i, item in enumerate(new) if key in item.cameras]
        path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=slot[0], file_index=slot[1])
        with atomic_path(path, tmp_name=path.name + TMP_SUFFIX) as tmp:
            spans = encode_episodes(tmp, [new[i].cameras[key] for i in positions], fps, self.cfg.video)
            info = video_info(tmp, self.cfg.video)
        height, width = new[positions[0]].cameras[key].shape[1:3]
        return EncodedCamera(slot, dict(zip(positions, spans)), video_feature(int(height), int(width), info))

    def _merge_meta_tail(self) -> None:
        """The newest small episodes-table files merged into one, under a new number, then removed
        (meta_files.py: why, and why a merge that dies half-way changes nothing); the small data
        files their episodes sit in are merged with them (data_files.py). Writer only."""
        files = list_meta_files(self.root)
        run = tail_to_merge(files, self.cfg.meta_merge_files, int(self.cfg.meta_file_mb * 2**20))
        if run:
            self._merge_meta_run(run, files)

    def compact_data_files(self) -> int:
        """Merge the small data files that older episodes-table files still name: a root grown
        before data files were merged with the episodes table keeps one data file per ingest (a
        DVC snapshot walks each). Each such episodes-table file is rewritten as a merge of one,
        the same commit protocol as the tail's; episodes and their frames are unchanged. Returns
        how many episodes-table files were rewritten."""
        rewritten = 0
        with self._writer():
            for meta in list_meta_files(self.root):
                rewritten += self._merge_meta_run([meta], list_meta_files(self.root), only_with_data=True)
        return rewritten

    def _merge_meta_run(self, run: list[MetaFile], files: list[MetaFile], only_with_data: bool = False) -> bool:
        """``run``'s rows (and the data files only they name) as one new episodes-table file, then
        the run removed and the merged-away data files moved aside. ``only_with_data``: nothing
        is written unless some data files merge. Returns whether anything was written."""
        chunk_size = self.chunk_size
        number = next_meta_number(files, chunk_size)
        chunk, file = divmod(number, chunk_size)
        rows = pa.concat_tables([read_meta_file(m.path) for m in run], promote_options="permissive")
        rows, merged_away = self._merge_data_files(dedupe_episodes(rows, EPISODE_INDEX).combine_chunks())
        if only_with_data and not merged_away:
            return False
        for name, value in ((META_META_CHUNK, chunk), (META_META_FILE, file)):
            rows = with_int_column(rows, name, np.full(rows.num_rows, value, dtype=np.int64))
        write_parquet(meta_file_path(self.root, number, chunk_size), rows, self.cfg.compression)  # commit
        for meta in run:
            meta.path.unlink(missing_ok=True)
        self._meta = read_episodes_table(self.root, EPISODE_INDEX)
        below = next_file_number(self._meta, self.chunk_size)
        leftovers = unreferenced(self.root, set(file_keys(self._meta)), below, chunk_size)  # of a merge that died
        supersede(self.root, sorted(set(merged_away) | set(leftovers)))
        sweep(self.root, self.cfg.superseded_retain_hours)
        return True

    def _merge_data_files(self, rows: pa.Table) -> tuple[pa.Table, list[tuple[int, int]]]:
        """``rows`` (episodes-table rows about to be merged) pointing at merged data files, and the
        keys of the files merged away. Only files that no episode outside ``rows`` names are
        merged, so the new episodes-table file is the one place that has to change."""
        assert self._meta is not None
        keys = np.stack([rows.column(META_DATA_CHUNK).to_numpy(), rows.column(META_DATA_FILE).to_numpy()], axis=1)
        everywhere = np.stack([self._meta.column(META_DATA_CHUNK).to_numpy(),
                               self._meta.column(META_DATA_FILE).to_numpy()], axis=1)
        starts, lengths = rows.column(META_FROM).to_numpy(), rows.column(META_LENGTH).to_numpy()
        candidates = []
        for key in np.unique(keys, axis=0):
            mine = (keys == key).all(axis=1)
            if int(mine.sum()) != int((everywhere == key).all(axis=1).sum()):
                continue
            first = int(starts[mine].min())
            frames = int((starts[mine] + lengths[mine]).max()) - first
            candidates.append(describe(self.root, (int(key[0]), int(key[1])), first, frames))
        groups = plan_data_merge(candidates, int(self.cfg.data_file_mb * 2**20))
        chunks, files = keys[:, 0].copy(), keys[:, 1].copy()
        number = next_file_number(self._meta, self.chunk_size)
        merged_away: list[tuple[int, int]] = []
        for offset, group in enumerate(groups):
            new_key = divmod(number + offset, self.chunk_size)
            write_merged(self.root, group, new_key, self.cfg.compression)
            for old in group:
                moved = (keys == np.array(old.key)).all(axis=1)
                chunks[moved], files[moved] = new_key
                merged_away.append(old.key)
        rows = with_int_column(rows, META_DATA_CHUNK, chunks)
        return with_int_column(rows, META_DATA_FILE, files), merged_away

    def _write_derived_meta(self, added: pa.Table | None = None) -> None:
        """info.json totals and stats.json, both derived from the episodes table: stats pooled
        from the last stats.json and the ``added`` rows when that file matches what was stored
        before them, else recomputed from every episode (after a crash, on repair)."""
        assert self._info is not None and self._meta is not None
        self._info = self.info()
        stats = pooled_stats(self.root / STATS_PATH, added, self.num_frames) if added is not None else None
        if stats is None:
            stats = stats_from_episodes_meta(self._meta)
        write_bytes(self.root / STATS_PATH, json.dumps(stats, indent=4).encode())
        write_bytes(self.root / INFO_PATH, json.dumps(self._info, indent=4).encode())


