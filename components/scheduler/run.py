"""One ``execute`` call as an object: setup (build the workers), the worker loop, the finish.

Before an op runs, its worker waits for its semantic predecessors (and, unless the op is hoisted,
for the previous iteration's barrier), takes its inputs from its local store or its inbox
channel, takes the device lock if the component is exclusive, sets its thread quota, runs, and
routes each output to the inboxes of the other workers that read it. Thread workers run ops here;
process workers' ops go to their ``ProcessHost`` (process_worker.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from components.config import SchedulerConfig
from components.scheduler.channels import Channel
from components.scheduler.graph import LegalityError, OpInstance, VersionKey, build_graph, slot_of
from components.scheduler.placement import (
    barrier_iteration,
    check_schedule,
    instance_devices,
    plan_workflow,
    programs,
    worker_of_instance,
)
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.process_worker import ProcessCall, ProcessHost, op_args, wait_all_ready
from components.scheduler.profiler import ActivitySampler, GpuTelemetry, OpTimer, Span, Timeline, Transfer
from components.scheduler.quotas import apply_blas_limit, mps_environment, set_worker_threads
from components.scheduler.run_result import ExecutionError, RunResult
from components.scheduler.wiring import device_registry, inboxes, routes
from components.scheduler.workflow import BuildContext, Workflow


@dataclass
class _Worker:
    """Per-worker bookkeeping of one run: its inbox, the versions it holds, its current quota."""

    spec: WorkerSpec
    inbox: Channel
    host: ProcessHost | None
    local: dict[VersionKey, Any] = field(default_factory=dict)
    in_process: set[VersionKey] = field(default_factory=set)  # versions held inside the worker's process
    threads: int | None = None


@dataclass
class _Reads:
    """What one op reads, as its worker supplies it: ``values`` to send (or pass), and for a process
    worker the versions its process already holds (``held``), should keep, or may drop after."""

    values: dict[VersionKey, Any] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)


def _lookup_input(inputs: Mapping[str, Any], key: VersionKey) -> Any:
    if str(key) in inputs:
        return inputs[str(key)]
    if key.state not in inputs:
        return None
    value = inputs[key.state]
    if key.part is not None and isinstance(value, dict) and key.part in value:
        return value[key.part]
    return value


class PlanRun:
    """One ``execute`` call: the unrolled graph, its workers and the shared bookkeeping they update."""

    def __init__(self, workflow: Workflow, plan: Plan, cfg: SchedulerConfig, iterations: range,
                 inputs: dict[str, Any], record: tuple[str, ...], gpu: GpuTelemetry | None,
                 on_iteration: Callable[[int, dict[str, Any]], None] | None) -> None:
        self.wf = wf = plan_workflow(workflow, plan)
        self.graph = graph = build_graph(wf, iterations, plan.buffers)
        check_schedule(graph, plan)
        self.plan, self.cfg, self.iterations, self.inputs = plan, cfg, iterations, inputs
        self.record, self.gpu, self.on_iteration = record, gpu, on_iteration
        self.progs = programs(graph, plan)
        self.route, self.local_readers = routes(graph, [worker_of_instance(plan, i) for i in graph.instances])
        self.registry = device_registry(wf, plan, cfg)
        self.channels = inboxes(plan, cfg, self.route, iterations)
        self.done = [threading.Event() for _ in graph.instances]
        self.per_iter_total: dict[int, int] = defaultdict(int)
        # the ops each iteration barrier waits for: its own, and a lagged op's trailing instances
        self.barrier_left: dict[int, int] = defaultdict(int)
        for inst in graph.instances:
            self.per_iter_total[inst.iteration] += 1
            self.barrier_left[barrier_iteration(plan, inst, iterations[-1])] += 1
        self.per_iter_done: dict[int, int] = defaultdict(int)
        self.barrier = {it: threading.Event() for it in iterations}
        for it in iterations:
            if self.barrier_left[it] == 0:
                self.barrier[it].set()
        self.meta = threading.Lock()
        self.progress_lock = threading.Lock()
        self.records: dict[VersionKey, Any] = {}
        self.final: dict[str, tuple[tuple[int, ...], Any]] = {}
        self.slots: dict[tuple[str, int | None, int], VersionKey] = {}
        for key in sorted(graph.inputs, key=lambda v: v.version):
            k = graph.buffers[key.state]
            if k is not None:
                self.slots[(key.state, key.part, slot_of(key, k))] = key
        self.spans: list[Span] = []
        self.transfers: list[Transfer] = []
        self.completion: list[int] = []
        self.errors: list[BaseException] = []
        self.origin = time.perf_counter()
        timer = OpTimer() if plan.cuda_streams else None
        # CUDA events only where CUDA is present; spans keep perf_counter times
        self.timer = timer if timer is not None and timer.cuda else None
        self.states: dict[tuple[str, str], Any] = {}
        self.hosts: dict[str, ProcessHost] = {}

    # ------------------------------------------------------------------ setup

    def build_workers(self, payload: Any, prebuilt: dict[str, Any]) -> None:
        """Build thread workers' component states here and start process workers (waiting until
        every process has built its components)."""
        wf, plan = self.wf, self.plan
        ctx = BuildContext(payload, dict(wf.loops))

        def context_of(component: str, worker: WorkerSpec) -> BuildContext:
            """A replica is told which env groups it serves (it may build only those)."""
            return replace(ctx, groups=worker.groups) if len(plan.hosts(component)) > 1 else ctx

        for w in plan.workers:
            if w.kind == "process":
                env = mps_environment({c: plan.gpu_percent[c] for c in w.components if c in plan.gpu_percent})
                threads = min((plan.threads.get(c, plan.default_threads or 0) or 0 for c in w.components),
                              default=0) or None
                bad = [c for c in w.components if not wf.component(c).process_ok]
                if bad:
                    raise LegalityError(f"plan {plan.name!r}: components {bad} cannot run in a process worker")
                self.hosts[w.name] = ProcessHost(w, wf, {c: context_of(c, w) for c in w.components}, threads, env,
                                                  plan.blas_threads)
            else:
                for c in w.components:
                    replicated = len(plan.hosts(c)) > 1
                    self.states[(w.name, c)] = (prebuilt[c] if c in prebuilt and not replicated
                                                else wf.component(c).factory(context_of(c, w)))
        wait_all_ready(self.hosts)

    # ------------------------------------------------------------------ run

    def run(self) -> RunResult:
        """Run every worker's program on its own thread, then gather what happened."""
        plan, cfg = self.plan, self.cfg
        t_start = time.perf_counter()
        switch_interval = sys.getswitchinterval()
        if cfg.gil_switch_interval_us > 0 and len(plan.workers) > 1:
            sys.setswitchinterval(cfg.gil_switch_interval_us / 1e6)
        with apply_blas_limit(plan.blas_threads), \
                ActivitySampler(cfg.sample_interval_ms / 1e3, self.origin, self.gpu) as sampler:
            threads = [threading.Thread(target=self.run_worker, args=(w,), name=f"worker-{w.name}", daemon=True)
                       for w in plan.workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - t_start
        sys.setswitchinterval(switch_interval)
        for h in self.hosts.values():
            h.stop()
        if self.errors:
            exc = self.errors[0]
            if isinstance(exc, (LegalityError, ExecutionError)):
                raise exc
            raise ExecutionError(f"plan {plan.name!r}: {type(exc).__name__}: {exc}") from exc
        return self.result(t_start, wall, sampler.samples)

    def result(self, t_start: float, wall: float, samples: Any) -> RunResult:
        iter_marks: list[tuple[float, float]] = []
        for it in self.iterations:
            its = [s for s in self.spans if s.iteration == it]
            iter_marks.append((min(s.start for s in its), max(s.end for s in its)))
        # iteration time = distance between consecutive iteration ends (hoisted work counts where it ran)
        ends = [e for _, e in iter_marks]
        starts = [t_start - self.origin, *ends[:-1]]
        gpu = self.gpu
        timeline = Timeline(sorted(self.spans, key=lambda s: s.start), samples, iter_marks,
                            "" if gpu is None or gpu.available else (gpu.reason if gpu else ""))
        return RunResult(
            plan=self.plan,
            graph_size=len(self.graph),
            records=self.records,
            final={k: v for k, (_, v) in self.final.items()},
            timeline=timeline,
            iteration_s=[e - s for s, e in zip(starts, ends)],
            wall_s=wall,
            lock_events=list(self.registry.events),
            switch=self.registry.stats(),
            channels={k: c.stats() for k, c in self.channels.items()},
            completion_order=self.completion,
            process_requests={name: h.requests for name, h in self.hosts.items()},
            transfers=self.transfers,
        )

    def fail(self, exc: BaseException) -> None:
        with self.meta:
            self.errors.append(exc)
        for ch in self.channels.values():
            ch.close()
        for e in self.done:
            e.set()
        for e in self.barrier.values():
            e.set()

    def run_worker(self, spec: WorkerSpec) -> None:
        with _worker_stream(self.plan.cuda_streams):
            self._run_worker(spec)

    def _run_worker(self, spec: WorkerSpec) -> None:
        try:
            if spec.cores is not None and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(threading.get_native_id(), set(spec.cores))
            worker = _Worker(spec, self.channels[spec.name], self.hosts.get(spec.name))
            prog = self.progs[spec.name]
            if worker.host is None:
                for uid in prog:
                    if not self.wait_ready(uid):
                        return
                    self.run_local(worker, uid)
            else:
                pos = 0
                while pos < len(prog):
                    if not self.wait_ready(prog[pos]):
                        return
                    batch = self.ready_run(spec.name, prog, pos)
                    self.run_remote(worker, batch)
                    pos += len(batch)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            self.fail(exc)

    # ------------------------------------------------------------------ readiness

    def barrier_before(self, inst: OpInstance) -> threading.Event | None:
        """The iteration barrier ``inst`` waits for (two back for hoisted ops), if any."""
        lag = 2 if inst.name in self.plan.hoist else 1
        return self.barrier.get(inst.iteration - lag) if self.plan.barrier else None

    def exclusive_devices(self, inst: OpInstance, worker: str) -> tuple[str, ...]:
        return instance_devices(self.plan, inst, worker) if self.wf.component(inst.component).exclusive else ()

    def wait_ready(self, uid: int) -> bool:
        """Block until op ``uid`` may start (its iteration barrier and semantic predecessors)."""
        if self.errors:
            return False
        gate = self.barrier_before(self.graph.instances[uid])
        if gate is not None:
            gate.wait()
        for p in self.graph.preds[uid]:
            self.done[p].wait()
        return not self.errors

    def ready_run(self, worker: str, prog: list[int], pos: int) -> list[int]:
        """The longest run of program ops from ``pos`` that can start now: each one's barrier is
        passed and its predecessors are done or earlier in the run, and at most one exclusive
        component's devices are involved. A process worker runs it on one request (no round trip
        per op), streaming each result back as it completes."""
        graph = self.graph
        batch = [prog[pos]]
        members = {prog[pos]}
        locks = {self.exclusive_devices(graph.instances[prog[pos]], worker)} - {()}
        for uid in prog[pos + 1:]:
            inst = graph.instances[uid]
            gate = self.barrier_before(inst)
            if gate is not None and not gate.is_set():
                break
            if any(p not in members and not self.done[p].is_set() for p in graph.preds[uid]):
                break
            devs = self.exclusive_devices(inst, worker)
            if devs and locks and devs not in locks:
                break
            locks |= {devs} - {()}
            batch.append(uid)
            members.add(uid)
        return batch

    # ------------------------------------------------------------------ one op

    def check_slots(self, inst: OpInstance, pending: dict[tuple[str, int | None, int], VersionKey]) -> None:
        """Every in-place read must find its version in its buffer slot (``pending``: slots written
        by ops of the same run that precede this one)."""
        for key in inst.reads:
            k = self.graph.buffers[key.state]
            if k is None:
                continue
            slot = (key.state, key.part, slot_of(key, k))
            with self.meta:
                held = pending.get(slot, self.slots.get(slot))
            if held != key:
                raise LegalityError(
                    f"{inst.label()} reads {key} but its buffer holds {held}: plan {self.plan.name!r} "
                    "reordered an in-place state without enough buffers"
                )

    def gather(self, worker: _Worker, inst: OpInstance) -> _Reads:
        """The versions ``inst`` reads, as this worker supplies them (a process worker does not
        resend what its process holds)."""
        reads = _Reads()
        for key in inst.reads:
            lk = (worker.spec.name, key)
            self.local_readers[lk] -= 1
            if key in worker.in_process:
                reads.held.append(str(key))
            else:
                if key in worker.local:
                    value = worker.local[key]
                elif key in self.graph.inputs:
                    value = _lookup_input(self.inputs, key)
                else:
                    value = worker.inbox.get(key)
                    worker.local[key] = value
                reads.values[key] = value
                if worker.host is not None and self.local_readers[lk] > 0:
                    reads.keep.append(str(key))
                    worker.in_process.add(key)
            if self.local_readers[lk] == 0:
                worker.local.pop(key, None)
                if key in worker.in_process:
                    reads.drop.append(str(key))
                    worker.in_process.discard(key)
        return reads

    def quota_of(self, inst: OpInstance) -> int | None:
        comp = self.wf.component(inst.component)
        quota = self.plan.threads.get(comp.name, self.plan.default_threads)
        if not inst.op.quota_invariant and comp.name in self.plan.pinned_threads:
            quota = self.plan.pinned_threads[comp.name]
        return quota

    def run_local(self, worker: _Worker, uid: int) -> None:
        inst = self.graph.instances[uid]
        self.check_slots(inst, {})
        args = op_args(inst.read_groups, self.gather(worker, inst).values)
        comp = self.wf.component(inst.component)
        quota = self.quota_of(inst)
        if quota is not None and quota != worker.threads:
            set_worker_threads(quota)
            worker.threads = quota
        devs = self.exclusive_devices(inst, worker.spec.name)
        t_lock = 0.0
        state = self.states[(worker.spec.name, comp.name)]
        if devs:
            on = (lambda s=state, h=comp.onload: h(s)) if comp.onload else None
            off = (lambda s=state, h=comp.offload: h(s)) if comp.offload else None
            t_lock = self.registry.acquire(devs, comp.name, comp.memory_mb, on, off)
        t0 = time.perf_counter()
        device_s: list[float] = []
        try:
            if self.timer is not None:
                with self.timer.time(device_s.append):
                    out = inst.op.fn(state, inst.indices, args)
            else:
                out = inst.op.fn(state, inst.indices, args)
        finally:
            t1 = time.perf_counter()
            if devs:
                self.registry.release(devs, comp.name, t_lock)
        self.finish(worker, uid, out or {}, t0, t1, device_s[0] if device_s else None)

    def run_remote(self, worker: _Worker, batch: list[int]) -> None:
        """Send a ready run of ops to the worker's process in one request; finish each op (record,
        route, mark done) as its result streams back, so readers elsewhere start as early as ever."""
        assert worker.host is not None
        calls, lock = self.remote_calls(worker, batch)
        t_lock = self.registry.acquire(lock[0], lock[1].name, lock[1].memory_mb, None, None) if lock else 0.0
        try:
            sent, t_sent = worker.host.send(calls)
            for k, (uid, call) in enumerate(zip(batch, calls)):
                out, t0, t1, size, received = worker.host.result(call.op)
                with self.meta:
                    if k == 0:  # the request crossed before the first op could start
                        self.transfers.append(Transfer(call.op, worker.spec.name, "in", sent, t0 - t_sent))
                    self.transfers.append(Transfer(call.op, worker.spec.name, "out", size, received - t1))
                self.finish(worker, uid, out or {}, t0, t1, None)
        finally:
            if lock:
                self.registry.release(lock[0], lock[1].name, t_lock)

    def remote_calls(self, worker: _Worker, batch: list[int]) -> tuple[list[ProcessCall], tuple[tuple[str, ...], Any] | None]:
        """The request for a ready run: one call per op (what to send, what the process holds, keeps
        and drops), and the exclusive devices to lock for it, if any."""
        calls: list[ProcessCall] = []
        pending: dict[tuple[str, int | None, int], VersionKey] = {}
        lock: tuple[tuple[str, ...], Any] | None = None
        for uid in batch:
            inst = self.graph.instances[uid]
            self.check_slots(inst, pending)
            for key in inst.writes:
                k = self.graph.buffers[key.state]
                if k is not None:
                    pending[(key.state, key.part, slot_of(key, k))] = key
            reads = self.gather(worker, inst)
            keep_out = tuple((k.state, str(k)) for k in inst.writes
                             if self.local_readers.get((worker.spec.name, k), 0) > 0)
            worker.in_process.update(k for k in inst.writes if (k.state, str(k)) in keep_out)
            calls.append(ProcessCall(inst.name, inst.indices, {str(k): v for k, v in reads.values.items()}, tuple(reads.held),
                               tuple((n, tuple(map(str, keys)), multi) for n, keys, multi in inst.read_groups),
                               tuple(reads.keep), keep_out, tuple(reads.drop)))
            devs = self.exclusive_devices(inst, worker.spec.name)
            if devs and lock is None:
                lock = (devs, self.wf.component(inst.component))
        return calls, lock

    def finish(self, worker: _Worker, uid: int, out: dict[str, Any], t0: float, t1: float,
               device_s: float | None) -> None:
        """Record one finished op, route its outputs, mark it done (and its iteration, if last)."""
        inst = self.graph.instances[uid]
        self.record_outputs(worker, inst, out, t0, t1, device_s)
        for key, dests in self.route[uid]:
            value = out.get(key.state)
            if self.local_readers.get((worker.spec.name, key), 0) > 0 and key not in worker.in_process:
                worker.local[key] = value
            for d in dests:
                self.channels[d].put(key, value)
        finished_iteration = False
        with self.meta:
            self.completion.append(uid)
            self.per_iter_done[inst.iteration] += 1
            gate = barrier_iteration(self.plan, inst, self.iterations[-1])
            self.barrier_left[gate] -= 1
            if self.barrier_left[gate] == 0:
                self.barrier[gate].set()
            if self.per_iter_done[inst.iteration] == self.per_iter_total[inst.iteration]:
                finished_iteration = True
                recorded = {k.state: v for k, v in self.records.items() if k.version[:1] == (inst.iteration,)}
        self.done[uid].set()
        if finished_iteration and self.on_iteration is not None:
            with self.progress_lock:
                self.on_iteration(inst.iteration, recorded)

    def record_outputs(self, worker: _Worker, inst: OpInstance, out: dict[str, Any], t0: float, t1: float,
                       device_s: float | None) -> None:
        """Buffer slots, recorded and final versions, and the op's span."""
        with self.meta:
            for key in inst.writes:
                k = self.graph.buffers[key.state]
                if k is not None:
                    self.slots[(key.state, key.part, slot_of(key, k))] = key
                elif key.state not in out:
                    raise ExecutionError(f"{inst.label()} did not return state {key.state!r} it declares")
                if key.state in self.record:
                    self.records[key] = out.get(key.state)
                if k is None and (key.state not in self.final or self.final[key.state][0] <= key.version):
                    self.final[key.state] = (key.version, out[key.state])
            self.spans.append(Span(inst.name, inst.label(), inst.component, worker.spec.name, inst.iteration,
                                   t0 - self.origin, t1 - self.origin, worker.threads or self.quota_of(inst) or 0,
                                   device_s))


@contextmanager
def _worker_stream(enabled: bool) -> Iterator[None]:
    """Run a worker's ops on its own CUDA stream (when asked and CUDA is present)."""
    if not enabled:
        yield
        return
    import torch

    if not torch.cuda.is_available():
        yield
        return
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
