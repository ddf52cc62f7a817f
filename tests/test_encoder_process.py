"""Video encodes with a deadline (components/episodes/encoder_process.py): a hung encoder process is
killed and the encode retried in a fresh one; when every attempt hangs, a clear error and no file.
The hang is a real one: the child encoder is stopped (SIGSTOP) mid-life, as a deadlocked SVT-AV1
leaves it: alive, idle, never answering."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from components.config import VideoConfig
from components.episodes.encoder_process import EncodeTimeout, EncoderProcess, encode_deadline_s
from components.episodes.video import read_all_frames

FPS = 10.0


def _frames(seed: int, n: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hung_encoder_is_killed_and_the_encode_retried_in_a_fresh_one(tmp_path):
    cfg = VideoConfig(encode_timeout_s=3.0, encode_min_fps=1000.0)
    encoder = EncoderProcess()
    try:
        first = tmp_path / "first.mp4"
        encoder.encode(first, [_frames(0)], FPS, VideoConfig())  # the child's first encode loads the codec
        hung = encoder.pid
        assert hung is not None and _alive(hung)
        os.kill(hung, signal.SIGSTOP)  # alive and silent, as a deadlocked encoder is
        path = tmp_path / "second.mp4"
        spans = encoder.encode(path, [_frames(1), _frames(2, 8)], FPS, cfg)
        assert encoder.pid != hung
        assert [(s.from_timestamp, s.to_timestamp) for s in spans] == [(0.0, 1.2), (1.2, 2.0)]
        assert read_all_frames(path)[0].shape == (20, 16, 16, 3)  # the retry wrote the whole file
        in_thread = tmp_path / "reference.mp4"
        from components.episodes.video import encode_here

        encode_here(in_thread, [_frames(1), _frames(2, 8)], FPS, cfg)
        assert np.array_equal(read_all_frames(path)[0], read_all_frames(in_thread)[0])
    finally:
        encoder.close()
    assert not _alive(hung)


class StopsEveryNewChild(EncoderProcess):
    """Each child it starts is stopped at once: every attempt hangs."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: list[int] = []

    def _connection(self, cfg):  # type: ignore[no-untyped-def]
        fresh = self._proc is None or self._proc.poll() is not None
        conn = super()._connection(cfg)
        if fresh:
            self.stopped.append(self.pid)
            os.kill(self.pid, signal.SIGSTOP)
        return conn


def test_when_every_attempt_hangs_the_encode_fails_naming_the_knobs_and_leaves_no_file(tmp_path):
    cfg = VideoConfig(encode_timeout_s=2.0, encode_min_fps=1000.0, encode_attempts=2)
    encoder = StopsEveryNewChild()
    path = tmp_path / "never.mp4"
    try:
        with pytest.raises(EncodeTimeout, match="encode_timeout_s"):
            encoder.encode(path, [_frames(3)], FPS, cfg)
    finally:
        encoder.close()
    assert not path.exists()
    assert len(set(encoder.stopped)) == 2  # a fresh child for the second attempt
    assert not any(_alive(pid) for pid in encoder.stopped)


def test_the_deadline_grows_with_the_frames():
    cfg = VideoConfig(encode_timeout_s=60.0, encode_min_fps=50.0)
    assert encode_deadline_s(100 + 150, cfg) == pytest.approx(65.0)


def test_an_encode_error_in_the_child_is_raised_here(tmp_path):
    encoder = EncoderProcess()
    try:
        with pytest.raises(ValueError, match="even width and height"):
            encoder.encode(tmp_path / "odd.mp4", [np.zeros((3, 15, 16, 3), np.uint8)], FPS, VideoConfig())
    finally:
        encoder.close()
