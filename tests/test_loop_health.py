"""components/fleet/loop_health.py: a stalled event loop and a garbage collection are seen and timed."""

from __future__ import annotations

import asyncio
import gc
import time

from components.fleet.loop_health import Durations, GcPauses, LoopLag


def test_a_blocking_call_on_the_loop_shows_as_lag_of_its_length():
    async def scenario() -> dict:
        lag = LoopLag(period_s=0.005)
        lag.start()
        await asyncio.sleep(0.05)  # idle: the probe wakes on time
        time.sleep(0.12)  # what an inline forward pass or a GIL-holding thread does to the loop
        await asyncio.sleep(0.03)
        await lag.stop()
        return lag.summary()

    summary = asyncio.run(scenario())
    assert summary["count"] >= 5
    assert 110 <= summary["max_ms"] < 1000  # the 120 ms block, not the idle probes
    assert summary["over_50_ms"] == 1 and summary["p50_ms"] < 50


def test_gc_pauses_are_timed_until_closed():
    pauses = GcPauses()
    gc.collect()
    assert pauses.count == 0  # not started: nothing installed
    pauses.start()
    try:
        gc.collect()
        gc.collect()
        assert pauses.count >= 2 and pauses.summary()["max_ms"] >= 0
    finally:
        pauses.close()
    seen = pauses.count
    gc.collect()
    assert pauses.count == seen  # closed: the callback is gone


def test_durations_summarize_in_milliseconds_and_empty_says_none():
    d = Durations()
    assert d.summary()["p99_ms"] is None and d.summary()["count"] == 0
    for s in (0.001, 0.002, 0.003, 0.2):
        d.add(s)
    out = d.summary(over_ms=100)
    assert out["count"] == 4 and out["max_ms"] == 200.0 and out["over_100_ms"] == 1 and out["p50_ms"] == 2.5
