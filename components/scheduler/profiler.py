"""Profiling: per-op spans, a device-activity timeline, and GPU telemetry that degrades cleanly.

* ``Span`` — one op execution (worker, component, start/end seconds from the run start).
* ``ActivitySampler`` — a background thread sampling CPU utilization: this process's busy cores
  (from ``/proc/self/stat``) and the whole machine's (``/proc/stat``, so other users' load shows).
* ``GpuTelemetry`` — NVML utilization (``nvmlDeviceGetUtilizationRates().gpu``: % of time any
  kernel ran) and, on Hopper, GPM SM activity (metric 2) and occupancy (metric 3). Without a GPU
  ``nvmlInit`` raises ``NVMLError_LibraryNotFound``: telemetry reports ``available=False`` and why.
* ``OpTimer`` — CUDA events around an op when CUDA is present, else ``perf_counter``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
GPM_SM_UTIL = 2  # NVML_GPM_METRIC_SM_UTIL
GPM_SM_OCCUPANCY = 3  # NVML_GPM_METRIC_SM_OCCUPANCY


@dataclass(frozen=True)
class Span:
    """One op execution."""

    op: str
    label: str
    component: str
    worker: str
    iteration: int
    start: float
    end: float
    threads: int
    device_s: float | None = None  # CUDA-event time of the op on its stream (GPU runs only)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Transfer:
    """One crossing of a process worker's pipe: a request ("in": parent pickles → the first op of
    the request starts in the child) or one op's streamed result ("out": the op ends in the child →
    its outputs are unpickled in the parent). ``seconds`` includes the wake-ups on both sides."""

    op: str
    worker: str
    direction: str  # "in" | "out"
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ActivitySample:
    """Busy cores at time ``t`` (seconds from run start): ours, and the whole machine's."""

    t: float
    process_cores: float
    machine_cores: float
    gpu_util: float | None = None
    sm_activity: float | None = None


@dataclass
class Timeline:
    """Spans and activity samples of one run."""

    spans: list[Span] = field(default_factory=list)
    activity: list[ActivitySample] = field(default_factory=list)
    iteration_bounds: list[tuple[float, float]] = field(default_factory=list)
    telemetry_note: str = ""

    def op_durations(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = defaultdict(list)
        for s in self.spans:
            out[s.op].append(s.duration)
        return dict(out)

    def median_op(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.op_durations().items()}

    def busy_by_worker(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for s in self.spans:
            out[s.worker] += s.duration
        return dict(out)

    def mean_process_cores(self, t0: float = 0.0, t1: float = float("inf")) -> float:
        xs = [a.process_cores for a in self.activity if t0 <= a.t <= t1]
        return statistics.fmean(xs) if xs else 0.0

    def mean_machine_cores(self) -> float:
        xs = [a.machine_cores for a in self.activity]
        return statistics.fmean(xs) if xs else 0.0


def _process_cpu_s() -> float:
    try:
        with open("/proc/self/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / _CLK_TCK
    except OSError:
        return time.process_time()


def _machine_busy_s() -> float:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / _CLK_TCK
    except OSError:
        return 0.0


CAPACITY_PROBE_SIZE = 256  # square matmul: long enough (~0.5 ms) to run outside the interpreter lock
CAPACITY_PROBE_REPEATS = 5  # alone/together pairs per capacity reading (median kept)


def effective_cores(devices: int, seconds: float = 0.1, repeats: int = CAPACITY_PROBE_REPEATS) -> float:
    """Cores this process can get right now, measured: the same lock-free kernel on one thread,
    then on ``devices`` threads at once; capacity = summed rate together / rate alone. The pair
    is taken ``repeats`` times in alternation and the median ratio kept: one reading right after a
    run (worker processes still exiting, a host burst) could read 1.2 on an idle 2-core machine.

    On a machine shared with other jobs it is below ``devices``: Linux CFS gives each session
    (autogroup) a fair share, so while another session keeps a core busy, a second worker of ours
    only splits our share. Plans are predicted on this capacity, not on the core count.
    """
    import torch

    a = torch.randn(CAPACITY_PROBE_SIZE, CAPACITY_PROBE_SIZE)

    def work(deadline: float, out: list[float]) -> None:
        torch.set_num_threads(1)  # per thread (OpenMP): the caller's setting is untouched
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() < deadline:
            torch.mm(a, a)
            n += 1
        out.append(n / (time.perf_counter() - t0))

    def run(k: int) -> float:
        rates: list[float] = []
        deadline = time.perf_counter() + seconds
        threads = [threading.Thread(target=work, args=(deadline, rates)) for _ in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(rates)

    if devices <= 1:
        return 1.0
    ratios = [run(devices) / max(run(1), 1e-9) for _ in range(repeats)]
    return min(max(statistics.median(ratios), 1.0), float(devices))


@dataclass(frozen=True)
class CapacityReading:
    """The capacity a plan is decided on: the best of ``readings`` (probes taken until one showed
    ``needed`` cores), and whether any did."""

    cores: float
    qualified: bool
    readings: tuple[float, ...]
    needed: float

    def note(self) -> str:
        """One line for a plan's notes."""
        seen = ", ".join(f"{x:.2f}" for x in self.readings)
        if self.qualified:
            return f"planned on a qualified capacity reading: {self.cores:.2f} cores (probes {seen}; needed {self.needed:.2f})"
        return (f"planned UNQUALIFIED: no capacity probe showed {self.needed:.2f} cores (probes {seen}); "
                f"planned on the best, {self.cores:.2f}")


def qualified_capacity(probe: Callable[[], float], devices: int, fraction: float, attempts: int, wait_s: float,
                       sleep: Callable[[float], None] = time.sleep) -> CapacityReading:
    """Probe capacity until a reading shows ``fraction · devices`` cores, at most ``attempts`` times
    with ``wait_s`` between them; the plan is then decided on the best reading seen. One reading can
    catch the host holding a core for a moment (run 10: 1.02 of 2 cores at planning, 1.8-2.0 in every
    round after), and a plan decided on it leaves the second core idle for as long as it is used."""
    needed = fraction * devices
    readings: list[float] = []
    for k in range(max(attempts, 1)):
        if k:
            sleep(wait_s)
        readings.append(probe())
        if readings[-1] >= needed:
            break
    best = max(readings)
    return CapacityReading(best, best >= needed, tuple(readings), needed)


def autogroup_scheduling() -> bool:
    """Whether Linux shares CPU fairly between sessions (``kernel.sched_autogroup_enabled``)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


class ActivitySampler:
    """Samples busy cores every ``interval_s`` on a daemon thread, until stopped."""

    def __init__(self, interval_s: float, origin: float, gpu: GpuTelemetry | None = None) -> None:
        self.interval_s = interval_s
        self.origin = origin
        self.gpu = gpu
        self.samples: list[ActivitySample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="activity-sampler", daemon=True)

    def __enter__(self) -> ActivitySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last_t, last_p, last_m = time.perf_counter(), _process_cpu_s(), _machine_busy_s()
        while not self._stop.wait(self.interval_s):
            t, p, m = time.perf_counter(), _process_cpu_s(), _machine_busy_s()
            dt = max(t - last_t, 1e-9)
            g = self.gpu.sample() if self.gpu is not None and self.gpu.available else None
            self.samples.append(ActivitySample(
                t - self.origin, (p - last_p) / dt, (m - last_m) / dt,
                None if g is None else g.gpu_util, None if g is None else g.sm_activity,
            ))
            last_t, last_p, last_m = t, p, m


@dataclass(frozen=True)
class GpuSample:
    gpu_util: float
    sm_activity: float | None
    sm_occupancy: float | None


class GpuTelemetry:
    """NVML + GPM sampling of one GPU; ``available`` is False (with ``reason``) where there is none."""

    def __init__(self, index: int = 0, use_gpm: bool = True) -> None:
        self.available = False
        self.gpm = False
        self.reason = ""
        self._nvml: Any = None
        self._handle: Any = None
        self._last_gpm: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.available = True
        except Exception as exc:  # NVMLError_LibraryNotFound without a GPU; ImportError without pynvml
            self.reason = f"{type(exc).__name__}: {exc}"
            return
        if use_gpm:
            try:
                support = self._nvml.nvmlGpmQueryDeviceSupport(self._handle)
                self.gpm = bool(getattr(support, "isSupportedDevice", 0))
                if self.gpm:
                    self._last_gpm = self._gpm_sample()
            except Exception as exc:  # pre-Hopper or old driver
                self.reason = f"GPM unavailable: {type(exc).__name__}: {exc}"
                self.gpm = False

    def _gpm_sample(self) -> Any:
        s = self._nvml.nvmlGpmSampleAlloc()
        self._nvml.nvmlGpmSampleGet(self._handle, s)
        return s

    def sample(self) -> GpuSample | None:
        if not self.available:
            return None
        util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        sm = occ = None
        if self.gpm:
            now = self._gpm_sample()
            try:
                m = self._nvml.c_nvmlGpmMetricsGet_t()
                m.version = self._nvml.NVML_GPM_METRICS_GET_VERSION
                m.numMetrics = 2
                m.sample1, m.sample2 = self._last_gpm, now
                m.metrics[0].metricId = GPM_SM_UTIL
                m.metrics[1].metricId = GPM_SM_OCCUPANCY
                self._nvml.nvmlGpmMetricsGet(m)
                sm, occ = float(m.metrics[0].value), float(m.metrics[1].value)
            finally:
                self._nvml.nvmlGpmSampleFree(self._last_gpm)
                self._last_gpm = now
        return GpuSample(util, sm, occ)

    def close(self) -> None:
        if self.available:
            if self._last_gpm is not None:
                self._nvml.nvmlGpmSampleFree(self._last_gpm)
                self._last_gpm = None
            self._nvml.nvmlShutdown()
            self.available = False


class OpTimer:
    """Times a block: CUDA events on the current stream when CUDA is present, else perf_counter."""

    def __init__(self) -> None:
        try:
            import torch

            self.cuda = bool(torch.cuda.is_available())
        except ImportError:  # pragma: no cover - torch is a dependency
            self.cuda = False
        self.backend = "cuda-events" if self.cuda else "perf_counter"

    @contextmanager
    def time(self, sink: Callable[[float], None]) -> Iterator[None]:
        if self.cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            sink(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            yield
            sink(time.perf_counter() - t0)
