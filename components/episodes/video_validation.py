"""Check an incoming episode's camera streams against its frame table; reject with a precise reason.

A camera stream comes as raw frames (``(T, H, W, 3)`` uint8, what the sims record) or as a video
file the robot encoded (one episode, frame i at i / fps). Either must hold exactly one frame per
row of the episode's table, at the table's timestamps (within LeRobot's tolerance), at the
dataset's resolution for that camera. The verdict is ``validation.py``'s: the checked frames, or
an ``EpisodeValidationError`` naming the source, the camera, what is wrong and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import av
import numpy as np

from components.episodes.record import Episode
from components.episodes.validation import EpisodeValidationError
from components.episodes.video import (
    CHANNELS,
    FrameTimestampError,
    read_all_frames,
    tolerance_s,
)

CameraStream = np.ndarray | Path  # raw frames, or a video file holding them


def validate_camera_streams(
    cameras: Mapping[str, CameraStream],
    episode: Episode,
    fps: float,
    resolutions: Mapping[str, tuple[int, int]],
    source: str,
) -> dict[str, np.ndarray]:
    """Each camera's frames, checked against ``episode`` (its table, validated already):
    ``resolutions`` holds the (height, width) the dataset stores for a camera (absent: any,
    the first episode fixes it). Raises ``EpisodeValidationError`` on the first problem."""
    checked: dict[str, np.ndarray] = {}
    for key, stream in sorted(cameras.items()):
        if "/" in key:
            raise EpisodeValidationError(source, key, "a camera key may not contain '/'",
                                         "name cameras like observation.images.scene")
        frames = _decoded(key, stream, episode, fps, source) if isinstance(stream, Path) else _raw(key, stream, source)
        if len(frames) != episode.length:
            raise EpisodeValidationError(
                source, key, f"{len(frames)} camera frames for {episode.length} table rows",
                "send one camera frame per frame of the episode",
            )
        _check_times(key, episode, fps, source)
        expected = resolutions.get(key)
        if expected is not None and tuple(frames.shape[1:3]) != tuple(expected):
            raise EpisodeValidationError(
                source, key, f"frames are {frames.shape[2]}x{frames.shape[1]}, the dataset stores {expected[1]}x{expected[0]}",
                "render this camera at the dataset's resolution (sim.camera.width/height) or ingest into a new root",
            )
        checked[key] = frames
    return checked


def _raw(key: str, frames: np.ndarray, source: str) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != CHANNELS:
        raise EpisodeValidationError(source, key, f"camera frames are {frames.shape} {frames.dtype}",
                                     "send (frames, height, width, 3) uint8 RGB frames")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise EpisodeValidationError(source, key, f"{frames.shape[2]}x{frames.shape[1]} frames",
                                     "use an even width and height (the stored video is yuv420p)")
    return frames


def _decoded(key: str, path: Path, episode: Episode, fps: float, source: str) -> np.ndarray:
    """A robot's video file: present, decodable, one frame per row at the table's time span."""
    if not path.is_file():
        raise EpisodeValidationError(source, key, f"video file {path} is missing", "send the episode's video with its table")
    try:
        frames, times = read_all_frames(path)
    except (av.FFmpegError, FrameTimestampError, OSError, IndexError) as exc:
        raise EpisodeValidationError(source, key, f"video file {path} is unreadable ({exc})",
                                     "send an mp4 (AV1 or H.264) holding this episode's frames") from exc
    if len(frames) == episode.length:
        table_span = float(episode.timestamps[-1] - episode.timestamps[0])
        video_span = float(times[-1] - times[0])
        if abs(video_span - table_span) > tolerance_s(fps):
            raise EpisodeValidationError(
                source, key, f"video spans {video_span:.4f} s, the table {table_span:.4f} s",
                "encode the episode's frames at the dataset's fps, one per table row",
            )
    return frames


def _check_times(key: str, episode: Episode, fps: float, source: str) -> None:
    """Frame i of the stored video is at i / fps: the table's timestamps must pick it (nearest)."""
    off = np.abs(episode.timestamps.astype(np.float64) - np.arange(episode.length) / fps)
    if (off >= 0.5 / fps).any():
        bad = int(np.flatnonzero(off >= 0.5 / fps)[0])
        raise EpisodeValidationError(
            source, key, f"timestamp {float(episode.timestamps[bad]):.4f} s of frame {bad} is not at the camera rate "
            f"{fps:g} fps ({bad / fps:.4f} s)", "record camera episodes at frame / fps (the dataset's fps)",
        )
