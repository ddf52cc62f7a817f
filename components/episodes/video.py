"""Camera streams as LeRobot v3 video features: encode episodes into mp4 files, read frames by timestamp.

    frames of several episodes (uint8 (T, H, W, 3) each) --encode_here--> one mp4 under
        videos/<key>/chunk-XXX/file-XXX.mp4 (back to back, frame i of the file at i / fps)
        + each episode's (from_timestamp, to_timestamp) in the file, for the episodes table
    an episode's timestamps + its from_timestamp --decode_frames--> the nearest decoded frames

Encoding follows LeRobot's defaults (``VideoEncoderConfig``: AV1 by SVT-AV1, yuv420p, a keyframe
every ``gop`` frames, crf, preset), in ``episodes.video``. Decoding follows LeRobot's PyAV reader
(``decode_video_frames_pyav``): seek to the keyframe at or before the first wanted time, decode
forward past the last, give each wanted time the nearest decoded frame, and refuse when that frame
is further than ``tolerance_s`` away; the tolerance is ``1 / fps - 1e-4`` (LeRobot's
``MultiLeRobotDataset.tolerance_s``), so a frame is found exactly when it exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Self

import av
import numpy as np

from components.config import VideoConfig

TOLERANCE_MARGIN_S = 1e-4  # LeRobot's: tolerance_s = 1 / fps - this
CHANNELS = 3  # rgb24 in, yuv420p stored
FRAME_FORMAT = "rgb24"
FPS_DENOMINATOR_LIMIT = 1001  # fps as a fraction (29.97 = 30000/1001)


class FrameTimestampError(ValueError):
    """A wanted time has no decoded frame within the tolerance (LeRobot's ``FrameTimestampError``)."""


@dataclass(frozen=True)
class EpisodeSpan:
    """Where one episode's frames lie in a video file (the ``videos/<key>/*_timestamp`` columns)."""

    from_timestamp: float
    to_timestamp: float


def tolerance_s(fps: float) -> float:
    """How far a decoded frame may be from the wanted time: just under one frame period."""
    return 1.0 / fps - TOLERANCE_MARGIN_S


def frame_rate(fps: float) -> Fraction:
    return Fraction(fps).limit_denominator(FPS_DENOMINATOR_LIMIT)


# SVT-AV1 prints its whole configuration to stderr at info level on every file it encodes (a demo
# round writes hundreds): errors only, unless the user asked for more (SVT-AV1's own variable).
os.environ.setdefault("SVT_LOG", "1")


def _codec_options(cfg: VideoConfig) -> dict[str, str]:
    """The encoder options LeRobot's ``VideoEncoderConfig.get_codec_options`` sets for the codec."""
    options = {"g": str(cfg.gop), "crf": str(cfg.crf)}
    if cfg.codec == "libsvtav1":
        options["preset"] = str(cfg.preset)
    return options


def check_frames(frames: np.ndarray, what: str) -> None:
    """One camera stream as the encoder takes it: (T >= 1, H, W, 3) uint8, even H and W (yuv420p)."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != CHANNELS or len(frames) == 0:
        raise ValueError(f"{what}: frames must be (frames >= 1, height, width, 3) uint8, got {frames.shape} {frames.dtype}")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"{what}: {frames.shape[2]}x{frames.shape[1]} frames; yuv420p needs an even width and height "
                         "(set sim.camera.width/height to even numbers)")


def encode_here(path: Path, streams: Sequence[np.ndarray], fps: float, cfg: VideoConfig) -> list[EpisodeSpan]:
    """Encode the episodes' frames back to back into one mp4 at ``path`` (frame i of the file at
    time i / fps), in the calling thread; returns each episode's span in it. All streams must share
    one resolution. The store encodes through ``encoder_process.encode_episodes`` (a deadline)."""
    if not streams:
        raise ValueError(f"{path}: no episodes to encode")
    height, width = streams[0].shape[1:3]
    rate = frame_rate(fps)
    spans: list[EpisodeSpan] = []
    written = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(cfg.codec, rate=rate, options=_codec_options(cfg))
        stream.width, stream.height, stream.pix_fmt = width, height, cfg.pix_fmt
        for frames in streams:
            check_frames(frames, str(path))
            if frames.shape[1:3] != (height, width):
                raise ValueError(f"{path}: {frames.shape[2]}x{frames.shape[1]} frames among {width}x{height} ones; "
                                 "one resolution per video key")
            for image in frames:
                frame = av.VideoFrame.from_ndarray(image, format=FRAME_FORMAT)
                frame.pts = written
                container.mux(stream.encode(frame))
                written += 1
            start = (written - len(frames)) / fps
            spans.append(EpisodeSpan(start, start + len(frames) / fps))
        container.mux(stream.encode(None))
    return spans


def video_info(path: Path, cfg: VideoConfig) -> dict[str, Any]:
    """The ``info`` of a video feature in ``info.json``, as LeRobot's ``get_video_info`` writes it:
    what the stream says, then the encoder settings it does not."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        info: dict[str, Any] = {
            "video.height": stream.height,
            "video.width": stream.width,
            "video.codec": stream.codec_context.codec.canonical_name,
            "video.pix_fmt": stream.pix_fmt,
            "video.fps": int(stream.base_rate) if stream.base_rate.denominator == 1 else float(stream.base_rate),
            "video.channels": CHANNELS,
            "has_audio": bool(container.streams.audio),
        }
    info.update({"video.g": cfg.gop, "video.crf": cfg.crf, "video.preset": cfg.preset, "video.is_depth_map": False})
    return info


def video_feature(height: int, width: int, info: dict[str, Any]) -> dict[str, Any]:
    """An ``info.json`` feature entry of a camera stream stored as video (LeRobot v3)."""
    return {"dtype": "video", "shape": [height, width, CHANNELS], "names": ["height", "width", "channels"], "info": info}


def decode_frames(path: Path, timestamps: Sequence[float], tolerance: float) -> np.ndarray:
    """The frames nearest to ``timestamps`` (seconds in the file), (n, H, W, 3) uint8; raises
    ``FrameTimestampError`` when one is further than ``tolerance`` from its nearest frame."""
    with VideoReader(path) as reader:
        return reader.frames_at(timestamps, tolerance)


class VideoReader:
    """One open video file, read as LeRobot's PyAV reader does (seek to the keyframe at or before
    the first wanted time, decode forward past the last), except that a read starting just after
    the previous one goes on decoding where that one stopped: consecutive episodes of one file
    (how a reader walks a dataset) cost no reopening and no seek back."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._container = av.open(str(path))
        self._stream = self._container.streams.video[0]
        self._stream.thread_type = "AUTO"  # frame threads: what PyAV read straight through uses
        self._time_base = float(self._stream.time_base)  # (a Fraction per frame costs ~5% of a read)
        self._decoded: Iterator[av.VideoFrame] | None = None
        self._last_time: float | None = None  # time of the last frame decoded

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._container.close()

    def frames_at(self, timestamps: Sequence[float], tolerance: float) -> np.ndarray:
        wanted = np.asarray(timestamps, dtype=np.float64)
        if wanted.size == 0:
            raise ValueError(f"{self.path}: no timestamps to decode")
        first, last = float(wanted.min()), float(wanted.max())
        if self._decoded is None or self._last_time is None or not (self._last_time < first <= self._last_time + tolerance * 2):
            self._seek(first)
        images: list[np.ndarray] = []
        times: list[float] = []
        assert self._decoded is not None
        for frame in self._decoded:
            if frame.pts is None:
                continue
            time = frame.pts * self._time_base
            self._last_time = time
            if time < first - tolerance:
                continue  # before the wanted span (decoded from the keyframe)
            images.append(frame.to_ndarray(format=FRAME_FORMAT))
            times.append(time)
            if time >= last - TOLERANCE_MARGIN_S:  # (float32 table times sit a hair past the frame's)
                break
        else:
            self._decoded = None  # the file ended: the next read seeks
        return _nearest(self.path, wanted, images, times, tolerance)

    def _seek(self, first: float) -> None:
        self._container.seek(max(int(first / self._time_base) - 1, 0), backward=True, any_frame=False,
                             stream=self._stream)
        self._decoded = iter(self._container.decode(self._stream))
        self._last_time = None


def _nearest(path: Path, wanted: np.ndarray, images: list[np.ndarray], times: list[float], tolerance: float) -> np.ndarray:
    """Each wanted time's nearest decoded frame; ``FrameTimestampError`` past the tolerance."""
    if not images:
        raise FrameTimestampError(f"{path}: no frame decodes in [{wanted.min():.4f}, {wanted.max():.4f}] s")
    decoded = np.asarray(times)
    nearest = np.abs(wanted[:, None] - decoded[None, :]).argmin(axis=1)
    gap = np.abs(decoded[nearest] - wanted)
    if (gap > tolerance).any():
        bad = int(np.flatnonzero(gap > tolerance)[0])
        raise FrameTimestampError(
            f"{path}: no frame within {tolerance:.4f} s of {wanted[bad]:.4f} s (nearest at {decoded[nearest[bad]]:.4f} s); "
            "the video does not cover the episode's timestamps"
        )
    return np.stack([images[i] for i in nearest])


def episode_frames(reader: VideoReader, span: EpisodeSpan, timestamps: np.ndarray, fps: float) -> np.ndarray:
    """An episode's frames at its table's ``timestamps`` (seconds from its start), as LeRobot reads
    them: shifted by the episode's ``from_timestamp`` in the file."""
    return reader.frames_at(span.from_timestamp + np.asarray(timestamps, dtype=np.float64), tolerance_s(fps))


def read_all_frames(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of a video file, (N, H, W, 3) uint8, and its time in seconds: what validation
    compares with an episode's table. Raises ``av.FFmpegError`` (or ``OSError``) if it does not decode."""
    images: list[np.ndarray] = []
    times: list[float] = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            if frame.pts is not None:
                images.append(frame.to_ndarray(format=FRAME_FORMAT))
                times.append(float(frame.pts * stream.time_base))
    if not images:
        raise FrameTimestampError(f"{path}: the video holds no frames")
    return np.stack(images), np.asarray(times)
