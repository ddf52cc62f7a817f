"""Where a served request's tail latency goes: event-loop stalls, garbage-collection pauses, forward passes.

A request waits behind whatever holds the service's event loop (and with it the interpreter lock):
a forward pass run inline, a collection of the cyclic garbage collector, a thread such as the
alias watcher holding the GIL. ``LoopLag`` wakes every ``period_s`` and records how late it woke;
``GcPauses`` times every collection; ``Durations`` keeps the batcher's forward passes. The service's
``/v1/stats`` reports all three as percentiles, so a p99 can be taken apart without a profiler.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import deque

import numpy as np

KEEP = 20_000  # recent samples per series (a minute of 10 ms loop probes, ~20k batches)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task of the loop and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class Durations:
    """Recent durations (seconds), summarized in milliseconds. Thread-safe appends (deque)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.samples: deque[float] = deque(maxlen=keep)
        self.count = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1

    def summary(self, over_ms: float = 50.0) -> dict:
        values = np.asarray(self.samples, dtype=float) * 1e3
        if not len(values):
            return {"count": self.count, "p50_ms": None, "p99_ms": None, "max_ms": None, f"over_{over_ms:g}_ms": 0}
        return {"count": self.count, "p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
                "max_ms": float(values.max()), "total_ms": float(values.sum()), f"over_{over_ms:g}_ms": int((values > over_ms).sum())}


class LoopLag(Durations):
    """How late the event loop wakes a ``period_s`` timer: 0 on an idle loop, the stall otherwise."""

    def __init__(self, period_s: float = 0.01, keep: int = KEEP) -> None:
        super().__init__(keep)
        self.period_s = period_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._probe())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.period_s)
            self.add(max(0.0, loop.time() - asked - self.period_s))


class GcPauses(Durations):
    """Every garbage collection's duration, by ``gc.callbacks`` (installed from ``start`` until ``close``)."""

    def __init__(self, keep: int = KEEP) -> None:
        super().__init__(keep)
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        now, thread = time.perf_counter(), threading.get_ident()
        with self._lock:
            if phase == "start":
                self._started[thread] = now
            elif thread in self._started:
                self.add(now - self._started.pop(thread))

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
