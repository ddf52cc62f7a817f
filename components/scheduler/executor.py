"""The executor: runs a workflow's unrolled graph under a plan, with workers, channels and locks.

Each worker (a thread, or a proxy thread driving a spawned process) has a *program*: its op
instances in sequential order, except hoisted ops, which move to the tail of the previous
iteration. Before an op runs, the worker waits for its semantic predecessors (and, unless the op
is hoisted, for the previous iteration's barrier), takes its inputs from its local store or its
inbox channel, takes the device lock if the component is exclusive, sets its thread quota, runs,
and routes each output to the inboxes of the other workers that read it.

In-place states are guarded at run time: every read checks that its buffer slot still holds the
version the sequential schedule would read (``LegalityError`` otherwise), so an illegal plan fails
instead of silently computing something else.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from components.config import SchedulerConfig
from components.scheduler.channels import Channel, ChannelStats
from components.scheduler.devices import DeviceRegistry, LockEvent, MemoryBudgetError, SwitchStats
from components.scheduler.graph import Graph, LegalityError, OpInstance, VersionKey, build_graph, slot_of
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.profiler import ActivitySampler, GpuTelemetry, OpTimer, Span, Timeline, Transfer
from components.scheduler.quotas import apply_blas_limit, mps_environment, set_worker_threads
from components.scheduler.workflow import BuildContext, Workflow

GROUP_LOOP = "group"
PROCESS_POLL_S = 0.5  # how often a parent checks that a silent process worker is still alive
WORKER_PRELOAD = ("torch", "components.scheduler.executor")  # imported once, in the fork server


def _worker_context(env: dict[str, str]) -> Any:
    """Where process workers come from. A fork server (started clean, like spawn, so LanceDB's and
    torch's threads in this process never reach a worker) that has imported torch once: each
    worker then starts in a fraction of a second instead of re-importing torch (~2.5 s of a core),
    which every process plan paid per run. Workers that need their own environment at launch (an
    MPS quota) are spawned: a fork server's children inherit the server's environment."""
    if env or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))
    return ctx


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


def plan_workflow(workflow: Workflow, plan: Plan) -> Workflow:
    """The workflow with the plan's env-group count applied (if it has a group loop)."""
    if plan.groups and GROUP_LOOP in workflow.loops and workflow.loops[GROUP_LOOP] != plan.groups:
        return workflow.replace_loops(**{GROUP_LOOP: plan.groups})
    return workflow


def worker_of_instance(plan: Plan, inst: OpInstance) -> str:
    """The worker that runs one op instance (a replicated component's group ops go to their replica)."""
    return plan.worker_of(inst.component, inst.indices.get(GROUP_LOOP)).name


def instance_devices(plan: Plan, inst: OpInstance, worker: str) -> tuple[str, ...]:
    """Devices whose lock an op instance takes: its component's placement, or for a replicated
    component the one device of that placement its replica owns (replicas never share a lock)."""
    devs = plan.placement.get(inst.component, ())
    if devs and len(plan.hosts(inst.component)) > 1:
        return (devs[plan.replica_index(inst.component, worker) % len(devs)],)
    return devs


def programs(graph: Graph, plan: Plan) -> dict[str, list[int]]:
    """Each worker's op order: sequential order, hoisted ops moved to the previous iteration's tail."""
    first = graph.iterations.start
    out: dict[str, list[tuple[float, int]]] = {w.name: [] for w in plan.workers}
    for inst in graph.instances:
        w = worker_of_instance(plan, inst)
        it = inst.iteration
        key = it - 0.5 if (inst.name in plan.hoist and it > first) else float(it)
        out[w].append((key, inst.uid))
    return {w: [u for _, u in sorted(v)] for w, v in out.items()}


def check_schedule(graph: Graph, plan: Plan) -> None:
    """Raise ``LegalityError`` if the plan's program order + barriers contradict the version edges.

    Semantic edges are always enforced, so a legal plan can only wait, never read a wrong
    version; an illegal one would deadlock (a cycle) — this check refuses it up front.
    """
    _check_placement(graph.workflow, plan)
    unknown = set(plan.hoist) - {op.name for op, _ in graph.workflow.ops_with_scope()}
    if unknown:
        raise LegalityError(f"plan {plan.name!r} hoists unknown ops {sorted(unknown)}")
    n = len(graph)
    its = list(graph.iterations)
    bidx = {it: n + k for k, it in enumerate(its)}  # barrier node of iteration it
    succ: list[list[int]] = [list(s) for s in graph.succs] + [[] for _ in its]
    for inst in graph.instances:
        succ[inst.uid].append(bidx[inst.iteration])
        if plan.barrier:
            lag = 2 if inst.name in plan.hoist else 1
            prev = inst.iteration - lag
            if prev in bidx:
                succ[bidx[prev]].append(inst.uid)
    for prog in programs(graph, plan).values():
        for a, b in zip(prog, prog[1:]):
            succ[a].append(b)
    indeg = [0] * len(succ)
    for s in succ:
        for d in s:
            indeg[d] += 1
    ready = [u for u in range(len(succ)) if indeg[u] == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for d in succ[u]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    if seen != len(succ):
        stuck = [graph.instances[u].label() for u in range(n) if indeg[u] > 0][:3]
        raise LegalityError(
            f"plan {plan.name!r}: its program order and barriers contradict the version dependencies "
            f"(would deadlock around {stuck}); un-hoist those ops or add the buffers they need"
        )


def _check_placement(workflow: Workflow, plan: Plan) -> None:
    """Every component placed once, or replicated: on several workers whose env groups partition the
    group loop, and only if the component declares itself ``replicable``."""
    names = {c.name for c in workflow.components}
    placed = [c for w in plan.workers for c in w.components]
    if set(placed) != names:
        raise LegalityError(f"plan {plan.name!r} must place every component: {sorted(set(placed))} vs {sorted(names)}")
    groups = workflow.loops.get(GROUP_LOOP)
    for c in sorted(names):
        hosts = plan.hosts(c)
        if len(hosts) == 1:
            continue
        if not workflow.component(c).replicable:
            raise LegalityError(f"plan {plan.name!r} places component {c!r} on {len(hosts)} workers, but it is not "
                                "replicable (its state is not per env group); place it once")
        served = sorted(g for w in hosts for g in (w.groups or ()))
        if groups is None or served != list(range(groups)):
            raise LegalityError(f"plan {plan.name!r}: the replicas of {c!r} serve env groups {served}; they must "
                                f"serve each of the workflow's {groups} groups exactly once (WorkerSpec.groups)")


# ----------------------------------------------------------------------------------------- process
def _op_args(read_groups, values: Mapping[Any, Any]) -> dict[str, Any]:
    """An op's named inputs from the versions it reads: a list for a multi-version read (one per
    group), else the one value. Thread and process workers bind them the same way."""
    return {name: [values[k] for k in keys] if multi else values[keys[0]] for name, keys, multi in read_groups}


def _process_main(conn: Any, workflow: Workflow, components: dict[str, BuildContext],
                  threads: int | None, cores: tuple[int, ...] | None, blas_threads: int | None = None) -> None:
    """Body of a process worker: build the hosted components, then run ops on request."""
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    if threads is not None:
        set_worker_threads(threads)
    with apply_blas_limit(blas_threads):  # the plan's BLAS limit is process-wide: apply it here too
        _serve(conn, workflow, components)


def _serve(conn: Any, workflow: Workflow, components: dict[str, BuildContext]) -> None:
    states = {c: workflow.component(c).factory(ctx) for c, ctx in components.items()}
    ops = {op.name: op for op, _ in workflow.ops_with_scope()}
    kept: dict[str, Any] = {}  # versions this worker reads again: sent (or produced) once, then held here
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        for call in msg[1]:
            op = ops[call.op]
            try:
                values = {**{k: kept[k] for k in call.held}, **call.values}
                kept.update({k: values[k] for k in call.keep})
                args = _op_args(call.groups, values)
                t0 = time.perf_counter()
                out = op.fn(states[op.component], call.indices, args)
                t1 = time.perf_counter()
                for state, key in call.keep_out:
                    kept[key] = (out or {}).get(state)
                for k in call.drop:
                    kept.pop(k, None)
            except Exception as exc:  # forwarded to the parent, which raises ExecutionError; the rest of
                conn.send(("error", f"{type(exc).__name__}: {exc}"))  # the run is skipped
                break
            conn.send(("ok", (out, t0, t1)))


@dataclass(frozen=True)
class _Call:
    """One op request to a process worker. Versions the worker reads more than once cross the pipe
    once: ``keep`` (inputs) and ``keep_out`` (its own outputs) stay in the process, later calls name
    them in ``held``, and ``drop`` releases those read for the last time."""

    op: str
    indices: dict[str, int]
    values: dict[str, Any]
    held: tuple[str, ...]
    groups: tuple[tuple[str, tuple[str, ...], bool], ...]
    keep: tuple[str, ...] = ()
    keep_out: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ()


class _ProcessHost:
    """Parent-side handle of a worker process (``_worker_context``: from a clean fork server, never
    forked from this process's LanceDB/torch threads). Construction launches it; ``wait_ready``
    waits for it to build its components, so a plan's workers start up side by side."""

    def __init__(self, spec: WorkerSpec, workflow: Workflow, contexts: dict[str, BuildContext], threads: int | None,
                 env: dict[str, str], blas_threads: int | None = None) -> None:
        mpctx = _worker_context(env)
        self.conn, child = mpctx.Pipe()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # MPS quota etc. must be in the child's environment at launch
        try:
            self.proc = mpctx.Process(target=_process_main, args=(child, workflow, contexts, threads,
                                                                 spec.cores, blas_threads),
                                      daemon=True, name=f"worker-{spec.name}")
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.name = spec.name
        self.requests = 0

    def wait_ready(self) -> None:
        kind, _ = self._recv("start")
        if kind != "ready":  # pragma: no cover
            raise ExecutionError(f"process worker {self.name} failed to start")

    def _recv(self, what: str) -> tuple[str, Any]:
        self._recv_wait(what)
        return self.conn.recv()

    def _recv_wait(self, what: str) -> None:
        """Wait for the child, failing clearly if it died (e.g. a main module without a __main__ guard)."""
        while not self.conn.poll(PROCESS_POLL_S):
            if not self.proc.is_alive():
                raise ExecutionError(
                    f"process worker {self.name} died during {what} (exit code {self.proc.exitcode}); spawned "
                    "workers re-import the main module, so scripts need an `if __name__ == '__main__':` guard"
                )

    def send(self, calls: list[_Call]) -> tuple[int, float]:
        """Ask the process to run ``calls`` in order; results stream back one per call (``result``).
        Returns the request's size in bytes and when its pickling began (``perf_counter``)."""
        t = time.perf_counter()
        # plain pickle, by value: Connection.send's ForkingPickler would move each CPU tensor's storage
        # into shared memory *in place* (torch's reduction), racing with the other workers that read
        # the same versioned state at that moment (seen: a learner loading params@i while they moved
        # gave different weights in 1 of 6 runs of the evaluator-in-a-side-process plan)
        body = pickle.dumps(("run", calls), protocol=pickle.HIGHEST_PROTOCOL)
        self.conn.send_bytes(body)
        self.requests += 1
        return len(body), t

    def result(self, op: str) -> tuple[dict[str, Any], float, float, int, float]:
        """The next streamed result: outputs, the op's start/end (``perf_counter``, system-wide), the
        message's size in bytes and when it was unpickled here (what ``Connection.recv`` does, timed)."""
        self._recv_wait(op)
        body = self.conn.recv_bytes()
        kind, payload = pickle.loads(body)
        received = time.perf_counter()
        if kind == "error":
            raise ExecutionError(payload)
        out, t0, t1 = payload
        return out, t0, t1, len(body), received

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):  # pragma: no cover
            pass
        self.proc.join(timeout=10)


def _wait_ready(hosts: dict[str, _ProcessHost]) -> None:
    """Wait until every launched process worker has built its components; if one fails, stop them all."""
    try:
        for h in hosts.values():
            h.wait_ready()
    except BaseException:
        for h in hosts.values():
            h.stop()
        raise


# ----------------------------------------------------------------------------------------- executor
@dataclass
class _Worker:
    """Per-worker bookkeeping of one run: its inbox, the versions it holds, its current quota."""

    spec: WorkerSpec
    inbox: Channel
    host: _ProcessHost | None
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


def execute(
    workflow: Workflow,
    plan: Plan,
    cfg: SchedulerConfig,
    payload: Any,
    iterations: range,
    inputs: Mapping[str, Any] | None = None,
    record: tuple[str, ...] = (),
    components: dict[str, Any] | None = None,
    gpu: GpuTelemetry | None = None,
    on_iteration: Callable[[int, dict[str, Any]], None] | None = None,
) -> RunResult:
    """Run ``iterations`` of ``workflow`` under ``plan``.

    ``payload`` goes to component factories; ``components`` may pass already-built component
    states (thread workers only) so a caller can keep them across calls. ``record`` names states
    whose every version is returned in ``RunResult.records``; ``final`` always holds the latest
    version of every immutable state. ``on_iteration(i, recorded)`` is called (from a worker
    thread, one call at a time) when every op of iteration ``i`` is done, with that iteration's
    recorded states — live progress for a caller.
    """
    run = _Run(workflow, plan, cfg, iterations, dict(inputs or {}), record, gpu, on_iteration)
    run.build_workers(payload, components or {})
    return run.run()


def _routes(graph: Graph, inst_worker: list[str]
            ) -> tuple[list[list[tuple[VersionKey, list[str]]]], dict[tuple[str, VersionKey], int]]:
    """Which other workers need each produced version, and each worker's local reader count per
    version (for eviction)."""
    route: list[list[tuple[VersionKey, list[str]]]] = [[] for _ in graph.instances]
    local_readers: dict[tuple[str, VersionKey], int] = defaultdict(int)
    for inst in graph.instances:
        for key in inst.writes:
            dests = sorted({inst_worker[r] for r in graph.readers.get(key, [])} - {inst_worker[inst.uid]})
            route[inst.uid].append((key, dests))
        for key in inst.reads:
            local_readers[(inst_worker[inst.uid], key)] += 1
    return route, local_readers


def _device_registry(wf: Workflow, plan: Plan, cfg: SchedulerConfig) -> DeviceRegistry:
    """The run's devices (cores, and GPUs the plan names) with their memory budgets, checked
    against every placed component."""
    devices = tuple(f"cpu{k}" for k in range(cfg.devices or (os.cpu_count() or 1)))
    if any(d.startswith("gpu") for v in plan.placement.values() for d in v):
        devices = devices + tuple(sorted({d for v in plan.placement.values() for d in v if d.startswith("gpu")}))
    budget = {d: (cfg.memory_budget_mb or float("inf")) for d in devices}
    for comp, devs in plan.placement.items():
        need = wf.component(comp).memory_mb
        for d in devs:
            if d not in budget:
                raise LegalityError(f"plan {plan.name!r} places {comp!r} on unknown device {d!r}; devices: {devices}")
            if need > budget[d]:
                raise MemoryBudgetError(
                    f"plan {plan.name!r}: component {comp!r} needs {need:.0f} MB but device {d} has a budget of "
                    f"{budget[d]:.0f} MB (scheduler.memory_budget_mb); place it on a larger device"
                )
    return DeviceRegistry(devices, budget)


def _inboxes(plan: Plan, cfg: SchedulerConfig, route: list[list[tuple[VersionKey, list[str]]]],
             iterations: range) -> dict[str, Channel]:
    """One inbox per worker. It holds at least two iterations of the worker's remote inputs: a
    legal plan (whose consumers may gather a whole rollout at once) never deadlocks on
    backpressure, while a producer still cannot run more than about two iterations ahead of its
    consumer."""
    remote_in: dict[str, int] = defaultdict(int)
    for outputs in route:
        for _, dests in outputs:
            for d in dests:
                remote_in[d] += 1
    per_iter = {w: -(-n // max(len(iterations), 1)) for w, n in remote_in.items()}
    return {
        w.name: Channel(f"inbox:{w.name}", max(cfg.channel_capacity, 2 * per_iter.get(w.name, 0)), cfg.channel_timeout_s)
        for w in plan.workers
    }


class _Run:
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
        self.route, self.local_readers = _routes(graph, [worker_of_instance(plan, i) for i in graph.instances])
        self.registry = _device_registry(wf, plan, cfg)
        self.channels = _inboxes(plan, cfg, self.route, iterations)
        self.done = [threading.Event() for _ in graph.instances]
        self.per_iter_total: dict[int, int] = defaultdict(int)
        for inst in graph.instances:
            self.per_iter_total[inst.iteration] += 1
        self.per_iter_done: dict[int, int] = defaultdict(int)
        self.barrier = {it: threading.Event() for it in iterations}
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
        self.hosts: dict[str, _ProcessHost] = {}

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
                self.hosts[w.name] = _ProcessHost(w, wf, {c: context_of(c, w) for c in w.components}, threads, env,
                                                  plan.blas_threads)
            else:
                for c in w.components:
                    replicated = len(plan.hosts(c)) > 1
                    self.states[(w.name, c)] = (prebuilt[c] if c in prebuilt and not replicated
                                                else wf.component(c).factory(context_of(c, w)))
        _wait_ready(self.hosts)

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
        args = _op_args(inst.read_groups, self.gather(worker, inst).values)
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

    def remote_calls(self, worker: _Worker, batch: list[int]) -> tuple[list[_Call], tuple[tuple[str, ...], Any] | None]:
        """The request for a ready run: one call per op (what to send, what the process holds, keeps
        and drops), and the exclusive devices to lock for it, if any."""
        calls: list[_Call] = []
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
            calls.append(_Call(inst.name, inst.indices, {str(k): v for k, v in reads.values.items()}, tuple(reads.held),
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
            if self.per_iter_done[inst.iteration] == self.per_iter_total[inst.iteration]:
                self.barrier[inst.iteration].set()
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


def build_states(workflow: Workflow, plan: Plan, payload: Any) -> dict[str, Any]:
    """Build every component's state once (to reuse across ``execute`` calls on thread workers)."""
    wf = plan_workflow(workflow, plan)
    ctx = BuildContext(payload, dict(wf.loops))
    return {c.name: c.factory(ctx) for c in wf.components}


Callback = Callable[[RunResult], None]
