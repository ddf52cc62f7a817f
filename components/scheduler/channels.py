"""Channels between workers: values addressed by route key, bounded for backpressure.

A ``Channel`` is one worker's inbox. Producers ``put(key, value)``; the consumer ``get(key)``s the
value it needs next, in any order (route keys are the version keys the op reads, as RLinf routes
batches by key). With ``capacity`` items waiting, ``put`` blocks until the consumer takes one:
a fast producer cannot run arbitrarily far ahead. Both sides time out with an error that names
the key, so a wrong plan fails loudly instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


class ChannelTimeout(RuntimeError):
    """A put or get waited longer than the channel's timeout (likely a deadlocked plan)."""


@dataclass(frozen=True)
class ChannelStats:
    puts: int
    gets: int
    max_depth: int
    put_wait_s: float


class Channel:
    """A keyed, bounded inbox."""

    def __init__(self, name: str, capacity: int, timeout_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"channel {name}: capacity must be >= 1 (scheduler.channel_capacity)")
        self.name = name
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._items: dict[Hashable, Any] = {}
        self._cond = threading.Condition()
        self._puts = self._gets = self._max_depth = 0
        self._put_wait = 0.0
        self._closed = False

    def put(self, key: Hashable, value: Any) -> None:
        with self._cond:
            if len(self._items) >= self.capacity:
                t0 = time.perf_counter()
                ok = self._cond.wait_for(lambda: len(self._items) < self.capacity or self._closed, self.timeout_s)
                self._put_wait += time.perf_counter() - t0
                if not ok:
                    raise ChannelTimeout(
                        f"channel {self.name}: put({key}) blocked {self.timeout_s:.0f}s with {len(self._items)} "
                        f"items waiting (capacity {self.capacity}); raise scheduler.channel_capacity or fix the plan"
                    )
            if key in self._items:
                raise RuntimeError(f"channel {self.name}: key {key} put twice")
            self._items[key] = value
            self._puts += 1
            self._max_depth = max(self._max_depth, len(self._items))
            self._cond.notify_all()

    def get(self, key: Hashable) -> Any:
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._items or self._closed, self.timeout_s)
            if self._closed and key not in self._items:
                raise ChannelTimeout(f"channel {self.name}: closed while waiting for {key}")
            if not ok:
                raise ChannelTimeout(
                    f"channel {self.name}: get({key}) waited {self.timeout_s:.0f}s; its producer never sent it"
                )
            self._gets += 1
            value = self._items.pop(key)
            self._cond.notify_all()
            return value

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> ChannelStats:
        with self._cond:
            return ChannelStats(self._puts, self._gets, self._max_depth, self._put_wait)
