"""Video encodes with a deadline: each runs in a child encoder process that a hung encode can be killed in.

    frames of several episodes --encode_episodes--> the child (one per Python process, started on
    first use, reused) encodes them with ``video.encode_here`` --> each episode's span
                                 no answer by the deadline: kill the child, remove the partial
                                 file, retry in a fresh child (``video.encode_attempts`` in all)

Why a process: SVT-AV1 (LeRobot's default codec) can deadlock inside ``svt_av1_enc_send_picture``,
idle, never returning. It happened here to both workers of a camera study at once while the
machine was under load (py-spy: the ``video-encode`` thread parked in libSvtAv1Enc, the ingest
waiting on it); upstream reports the same (SVT-AV1 #2300, #2311). A thread stuck in C cannot be
stopped, and the ingest holds the dataset's writer lock while it waits, so a hang would stall
every later ingest. The deadline is ``encode_timeout_s + frames / encode_min_fps``: generous
for a loaded machine (an encode of 64x64 frames runs at thousands of frames/s), short against
forever. The child writes only the file it was given (a temporary path the caller renames into
place after the encode), so a killed encode leaves nothing stored half-written.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from components.config import VideoConfig
from components.episodes.video import EpisodeSpan, encode_here

log = logging.getLogger(__name__)

READY = "ready"


class EncodeTimeout(RuntimeError):
    """Every attempt at an encode passed its deadline."""


def encode_deadline_s(frames: int, cfg: VideoConfig) -> float:
    """Seconds an encode of ``frames`` frames may take before its child is taken for hung."""
    return cfg.encode_timeout_s + frames / cfg.encode_min_fps


def _serve(conn: Connection) -> None:
    """The child: say it is ready, then encode each job it is sent and answer (True, spans) or
    (False, the exception); exit when the parent's end closes."""
    conn.send(READY)
    while True:
        try:
            path, streams, fps, cfg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            conn.send((True, encode_here(Path(path), streams, fps, cfg)))
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            conn.send((False, exc))


class EncoderProcess:
    """One child encoder, started on first use; encodes are serialized (one child, one socket).

    The child is ``python -m components.episodes.encoder_process`` on this interpreter's import
    path: it imports PyAV and this package only (a multiprocessing child would import the parent's
    ``__main__``, torch and all, before its first encode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None before the first encode or after ``close``)."""
        return None if self._proc is None else self._proc.pid

    def encode(self, path: Path, streams: Sequence[np.ndarray], fps: float, cfg: VideoConfig) -> list[EpisodeSpan]:
        frames = sum(len(s) for s in streams)
        deadline = encode_deadline_s(frames, cfg)
        with self._lock:
            for attempt in range(1, cfg.encode_attempts + 1):
                conn = self._connection(cfg)
                conn.send((str(path), list(streams), fps, cfg))
                if conn.poll(deadline):
                    ok, value = conn.recv()
                    if ok:
                        return value
                    raise value
                log.warning("video encode of %s (%d frames) gave no answer in %.0f s (attempt %d of %d): the encoder "
                            "process is killed%s", path, frames, deadline, attempt,
                            cfg.encode_attempts, " and the encode retried" if attempt < cfg.encode_attempts else "")
                self.close()
                Path(path).unlink(missing_ok=True)
        raise EncodeTimeout(f"{path}: {cfg.encode_attempts} encodes each passed their {deadline:.0f} s deadline "
                            f"(episodes.video.encode_timeout_s + frames / encode_min_fps); raise them on a slow "
                            f"machine, or set episodes.video.codec: h264")

    def _connection(self, cfg: VideoConfig) -> Connection:
        if self._proc is not None and self._proc.poll() is None:
            assert self._conn is not None
            return self._conn
        self.close()
        mine, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the parent's code
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], env=env,
                                      pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(mine.detach())
        if not self._conn.poll(cfg.encoder_start_timeout_s) or self._conn.recv() != READY:
            self.close()
            raise EncodeTimeout(f"the video encoder process did not start in {cfg.encoder_start_timeout_s:.0f} s "
                                "(episodes.video.encoder_start_timeout_s)")
        return self._conn

    def close(self) -> None:
        """Kill the child (a hung one does not answer a polite request)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None


_ENCODER = EncoderProcess()


def encode_episodes(path: Path, streams: Sequence[np.ndarray], fps: float, cfg: VideoConfig) -> list[EpisodeSpan]:
    """``video.encode_here`` in this process's child encoder, with its deadline and retries."""
    return _ENCODER.encode(path, streams, fps, cfg)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
