"""What one ``execute`` call returns (``RunResult``) and the error an op raised inside a worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from components.scheduler.channels import ChannelStats
from components.scheduler.devices import LockEvent, SwitchStats
from components.scheduler.graph import VersionKey
from components.scheduler.plan import Plan
from components.scheduler.profiler import Timeline, Transfer


class ExecutionError(RuntimeError):
    """An op raised inside a worker; the message names the op instance."""


@dataclass(frozen=True)
class RunResult:
    """What one run produced and how it ran."""

    plan: Plan
    graph_size: int
    records: dict[VersionKey, Any]
    final: dict[str, Any]
    timeline: Timeline
    iteration_s: list[float]
    wall_s: float
    lock_events: list[LockEvent]
    switch: SwitchStats
    channels: dict[str, ChannelStats]
    completion_order: list[int] = field(default_factory=list)
    process_requests: dict[str, int] = field(default_factory=dict)  # process worker -> requests sent to it
    transfers: list[Transfer] = field(default_factory=list)  # every pipe crossing of a process worker (bytes, s)


Callback = Callable[[RunResult], None]
