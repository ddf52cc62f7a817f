"""Per-robot upload rate limit: a token bucket per robot; over it, 429 with Retry-After.

    bucket(robot) holds up to ``burst`` tokens, refilled at ``rate_per_s``; an upload takes one.
    empty -> wait_s = time until one token is back -> 429, ``Retry-After: ceil(wait_s)``

One robot flooding the ingest service (a bug, a stolen token) slows only itself: the others keep
their own buckets. Clocks are monotonic; memory is one small entry per known robot.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class UploadRateLimiter:
    """Token buckets keyed by robot id (thread-safe)."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"runtime.upload_rate_per_s must be > 0 and runtime.upload_burst >= 1 (got {rate_per_s}, {burst})")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, robot_id: str, now: float | None = None) -> float:
        """Take one token for ``robot_id``: 0.0 if allowed, else seconds until one is available."""
        now = time.monotonic() if now is None else now
        with self._lock:
            bucket = self._buckets.setdefault(robot_id, _Bucket(float(self.burst), now))
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * self.rate_per_s)
            bucket.stamp = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return 0.0
            return (1.0 - bucket.tokens) / self.rate_per_s


def retry_after_header(wait_s: float) -> str:
    """HTTP ``Retry-After`` (whole seconds, at least 1)."""
    return str(max(1, math.ceil(wait_s)))
