"""Per-device locks for context switching, with onload/offload hooks and a memory budget.

Exclusive components (models) hold the lock of every device they are placed on while an op runs.
When a device changes hands, the new owner is onloaded (its ``onload`` hook; on a GPU: weights
and optimizer state back into device memory); if that would exceed the device's memory budget,
resident components that do not hold the device are offloaded first, least recently used first.
Every acquisition is logged so tests can check that no device ever had two owners at once and
that resident memory never exceeded the budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class MemoryBudgetError(RuntimeError):
    """A component does not fit on its device even after offloading everything else."""


@dataclass(frozen=True)
class LockEvent:
    device: str
    owner: str
    acquired: float
    released: float


@dataclass(frozen=True)
class SwitchStats:
    switches: int
    onloads: int
    offloads: int
    switch_s: float
    peak_memory_mb: dict[str, float]


@dataclass
class _Resident:
    memory_mb: float
    last_used: float
    offload: Callable[[], None] | None


class DeviceRegistry:
    """Locks and resident-memory accounting for a set of named devices."""

    def __init__(self, devices: tuple[str, ...], budget_mb: dict[str, float]) -> None:
        self.devices = devices
        self.budget_mb = budget_mb
        self._locks = {d: threading.Lock() for d in devices}
        self._owner: dict[str, str | None] = {d: None for d in devices}
        self._holding: dict[str, str | None] = {d: None for d in devices}
        self._resident: dict[str, dict[str, _Resident]] = {d: {} for d in devices}
        self._meta = threading.Lock()
        self.events: list[LockEvent] = []
        self._switches = self._onloads = self._offloads = 0
        self._switch_s = 0.0
        self._peak = {d: 0.0 for d in devices}

    def _check(self, device: str) -> None:
        if device not in self._locks:
            raise KeyError(f"unknown device {device!r}; plan devices are {self.devices}")

    def acquire(self, devices: tuple[str, ...], owner: str, memory_mb: float,
                onload: Callable[[], None] | None, offload: Callable[[], None] | None) -> float:
        """Lock ``devices`` (sorted, so two owners never deadlock) for ``owner``; returns time acquired."""
        for d in sorted(devices):
            self._check(d)
            self._locks[d].acquire()
            with self._meta:
                self._holding[d] = owner
        t_lock = t0 = time.perf_counter()
        for d in sorted(devices):
            self._make_resident(d, owner, memory_mb, onload, offload)
        t1 = time.perf_counter()
        with self._meta:
            self._switch_s += t1 - t0
        return t_lock

    def _make_resident(self, device: str, owner: str, memory_mb: float,
                       onload: Callable[[], None] | None, offload: Callable[[], None] | None) -> None:
        with self._meta:
            switched = self._owner[device] not in (None, owner)
            self._owner[device] = owner
            if switched:
                self._switches += 1
            res = self._resident[device]
            if owner in res:
                res[owner].last_used = time.perf_counter()
                return
            budget = self.budget_mb.get(device, float("inf"))
            if memory_mb > budget:
                raise MemoryBudgetError(
                    f"component {owner!r} needs {memory_mb:.0f} MB but device {device} has a budget of "
                    f"{budget:.0f} MB (scheduler.memory_budget_mb); place it on a larger device"
                )
            victims = sorted((n for n in res if self._holding_any(n, device)), key=lambda n: res[n].last_used)
            used = sum(r.memory_mb for r in res.values())
            to_offload = []
            while used + memory_mb > budget and victims:
                v = victims.pop(0)
                used -= res[v].memory_mb
                to_offload.append((v, res.pop(v)))
        for _, r in to_offload:
            if r.offload is not None:
                r.offload()
        with self._meta:
            self._offloads += len(to_offload)
            used = sum(r.memory_mb for r in res.values())
            if used + memory_mb > budget:
                raise MemoryBudgetError(
                    f"device {device}: {owner!r} ({memory_mb:.0f} MB) does not fit next to "
                    f"{sorted(res)} in a {budget:.0f} MB budget"
                )
            res[owner] = _Resident(memory_mb, time.perf_counter(), offload)
            self._onloads += 1
            self._peak[device] = max(self._peak[device], used + memory_mb)
        if onload is not None:
            onload()

    def _holding_any(self, name: str, device: str) -> bool:
        """True if ``name`` may be offloaded from ``device`` (it does not hold the device now)."""
        return self._holding[device] != name

    def release(self, devices: tuple[str, ...], owner: str, acquired: float) -> None:
        now = time.perf_counter()
        with self._meta:
            for d in devices:
                self.events.append(LockEvent(d, owner, acquired, now))
                self._holding[d] = None
        for d in sorted(devices, reverse=True):
            self._locks[d].release()

    def stats(self) -> SwitchStats:
        with self._meta:
            return SwitchStats(self._switches, self._onloads, self._offloads, self._switch_s, dict(self._peak))


def max_concurrent_owners(events: list[LockEvent]) -> dict[str, int]:
    """Per device, the largest number of lock holders at any instant (1 means exclusive)."""
    out: dict[str, int] = {}
    by_dev: dict[str, list[LockEvent]] = {}
    for e in events:
        by_dev.setdefault(e.device, []).append(e)
    for dev, evs in by_dev.items():
        points = sorted([(e.acquired, 1) for e in evs] + [(e.released, -1) for e in evs], key=lambda p: (p[0], p[1]))
        cur = peak = 0
        for _, delta in points:
            cur += delta
            peak = max(peak, cur)
        out[dev] = peak
    return out


def noop(_: Any = None) -> None:
    """A hook that does nothing (CPU components have nothing to move)."""
