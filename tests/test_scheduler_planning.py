"""Cost curves, the M2Flow planner, Rose, slack quotas, the SM model and the profiler fallbacks."""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import pytest
import torch

from components.config import SchedulerConfig
from components.scheduler.costmodel import fit_curve
from components.scheduler.executor import execute
from components.scheduler.plan import Plan, WorkerSpec, sequential_plan
from components.scheduler.planner import ChainSpec, M2FlowPlanner, Profile
from components.scheduler.profiler import ActivitySampler, GpuTelemetry, OpTimer, Span, Timeline
from components.scheduler.quotas import (
    MPS_ENV,
    Branch,
    ForkJoin,
    SlackQuotaManager,
    mps_environment,
    set_worker_threads,
)
from components.scheduler.rose import RoseOptimizer, low_activity_windows
from components.scheduler.sm_model import LABEL, SmModelParams, study
from components.scheduler.synthetic import SyntheticSpec, _mlp, params_of, synthetic_workflow
from components.scheduler.workflow import BuildContext, Component, OpSpec, StateSpec, Workflow

X = np.array([8.0, 16, 32, 64, 128, 256])


@pytest.mark.parametrize(
    ("kind", "ys"),
    [
        ("power", 2e-5 * X**0.8),
        ("exponential", 1e-3 * np.exp(0.01 * X)),
        ("log", 1e-3 + 4e-4 * np.log(X)),
        ("quadratic", 1e-3 + 2e-6 * X + 3e-8 * X**2),
    ],
)
def test_cost_curve_picks_the_generating_form(kind, ys):
    curve = fit_curve(X, ys)
    assert curve.kind == kind
    assert curve.r2 > 0.999
    assert curve(100.0) == pytest.approx(float(fit_curve(X, ys)(100.0)))
    assert math.isclose(curve(64.0), float(ys[3]), rel_tol=1e-3)


def _profile(env_per_row: float, infer_fixed: float, learn: float, threads_speedup: float = 1.6) -> Profile:
    prof = Profile()
    for size in (16.0, 32.0, 64.0):
        for t in (1, 2):
            s = 1.0 if t == 1 else 1 / threads_speedup
            prof.samples[("env_step", t)].append((size, env_per_row * size))
            prof.samples[("infer", t)].append((size, (infer_fixed + 1e-5 * size) * s))
            for op in ("reset", "advantage"):
                prof.samples[(op, t)].append((size, 1e-5 * size))
            for op in ("sync", "retrieve", "eval"):
                prof.samples[(op, t)].append((64.0, 1e-4))
    for t in (1, 2):
        prof.samples[("learn", t)].append((64.0, learn if t == 1 else learn / threads_speedup))
    return prof


SPEC = SyntheticSpec(envs=64, steps=8, hidden=16, eval_steps=2, retrieval_sleep_s=0.0)


def _planner(prof: Profile, budget: float = 0.0) -> M2FlowPlanner:
    cfg = SchedulerConfig(pipeline_stages=(1, 2, 4), memory_budget_mb=budget)
    chain = ChainSpec(("sim", "policy", "learner"), {("sim", "policy"): "cyclic"}, envs=SPEC.envs)
    return M2FlowPlanner(lambda m: synthetic_workflow(SPEC, groups=m), chain, prof, cfg, devices=2)


def test_planner_pipelines_when_env_and_inference_balance():
    result = _planner(_profile(env_per_row=2e-5, infer_fixed=1e-5, learn=0.05)).plan()
    best = result.best
    assert best.stages > 1
    assert "sim@[0] | policy@[1]" in best.tree.describe()
    assert "chosen" in result.table()
    # the predicted time is the cyclic pipeline formula plus per-iteration work, by hand:
    planner = _planner(_profile(env_per_row=2e-5, infer_fixed=1e-5, learn=0.05))
    wf = synthetic_workflow(SPEC, groups=best.stages)
    times = {n.describe(): t for t, n in planner.search(best.stages)}
    assert times[best.tree.describe()] + planner.side_cost(wf) == pytest.approx(best.predicted_s)


def test_planner_stays_collocated_when_per_call_overhead_dominates():
    result = _planner(_profile(env_per_row=1e-7, infer_fixed=2e-3, learn=0.05)).plan()
    assert result.best.stages == 1  # splitting only multiplies the fixed per-call cost


def test_planner_respects_the_memory_budget():
    prof = _profile(env_per_row=2e-5, infer_fixed=1e-5, learn=0.05)
    # policy (10 MB) + learner (30 MB) cannot be resident together in 35 MB: collocating them pays offloads
    def by_layout(result):
        return {(c.stages, tuple(sorted(c.plan.placement.items())), len(c.plan.workers)): c.predicted_s
                for c in result.candidates}

    tight, free = by_layout(_planner(prof, budget=35.0).plan()), by_layout(_planner(prof).plan())
    shared = (1, (("learner", ("cpu0", "cpu1")), ("policy", ("cpu0", "cpu1"))), 1)  # all on one worker
    assert tight[shared] > free[shared]  # the offload/onload cost is charged
    split = (1, (("learner", ("cpu1",)), ("policy", ("cpu0",))), 2)
    assert tight[split] == pytest.approx(free[split])  # on separate devices nothing is swapped
    with pytest.raises(ValueError, match="memory budget"):
        _planner(prof, budget=20.0).plan()  # the learner alone does not fit anywhere


def _rose_setup(measure_bias: float = 1.0):
    cfg = SchedulerConfig(activity_threshold=0.99, min_window_ms=0.0, accept_margin=0.02)
    wf = synthetic_workflow(SPEC, groups=2)
    durations = {"retrieve": 0.004, "sync": 1e-4, "reset": 0.002, "infer": 5e-4, "env_step": 5e-4,
                 "advantage": 1e-4, "learn": 0.01, "eval": 0.006}
    from components.scheduler.executor import plan_workflow
    from components.scheduler.graph import build_graph
    from components.scheduler.simulate import simulate

    def predict(p: Plan, basis: Plan | None = None) -> float:
        g = build_graph(plan_workflow(wf, p), range(3), p.buffers)
        return simulate(g, p, lambda i, t: durations[i.name], lambda i, t: 1.0, 2.0).iteration

    calls: list[list[str]] = []

    def measure(plans: list[Plan]) -> list[float]:
        calls.append([p.name for p in plans])
        return [predict(plans[0]), predict(plans[1]) * measure_bias]

    spans = [Span("learn", "learn", "learner", "main", 1, 0.0, 0.01, 1), Span("eval", "eval", "evaluator", "main", 1, 0.01, 0.016, 1)]
    base = Plan("base", (WorkerSpec("sim", ("sim",)), WorkerSpec("pol", ("policy",)),
                         WorkerSpec("rest", ("learner", "evaluator", "retriever"))), groups=2, default_threads=1)
    opt = RoseOptimizer(wf, cfg, 2, measure, predict, lambda p: Timeline(spans))
    return opt, base, calls


def test_rose_keeps_measured_gains_and_refuses_illegal_rewrites():
    opt, base, calls = _rose_setup()
    result = opt.optimize(base)
    kept = [d.name for d in result.decisions if d.kept]
    refused = [d.name for d in result.decisions if not d.legal]
    assert "side_worker" in kept  # eval with the previous weights overlaps the rollout
    assert "hoist:infer" in refused and "hoist:learn" in refused
    assert calls, "every kept rewrite must be validated by a measured run"
    assert any(w.components == ("evaluator", "retriever") for w in result.plan.workers)
    # the optimized plan computes exactly what the sequential schedule computes
    wf = synthetic_workflow(SPEC, groups=2)
    inputs = {"params": params_of(_mlp(SPEC))}
    ref = execute(wf, sequential_plan(wf, threads=1), SchedulerConfig(), SPEC, range(3), inputs, record=("digest",))
    got = execute(wf, result.plan, SchedulerConfig(), SPEC, range(3), inputs, record=("digest",))
    assert got.records == ref.records


def test_rose_rolls_back_when_the_measurement_disagrees():
    opt, base, _ = _rose_setup(measure_bias=1.5)  # every proposal measures 50% slower than predicted
    result = opt.optimize(base)
    assert result.plan == base
    assert any(d.measured_after_s and not d.kept for d in result.decisions)


def test_low_activity_windows_found_on_a_serial_tail():
    spans = [Span("a", "a", "c", "w1", 0, 0.0, 0.010, 1), Span("b", "b", "c", "w2", 0, 0.0, 0.010, 1),
             Span("learn", "learn", "c", "w1", 0, 0.010, 0.030, 1)]
    windows = low_activity_windows(Timeline(spans), capacity=2, threshold=0.75, min_window_s=0.005)
    assert len(windows) == 1 and windows[0].running == ("learn",)
    assert windows[0].start == pytest.approx(0.010) and windows[0].busy_cores == pytest.approx(1.0)


def test_slack_quota_manager_moves_quota_to_the_critical_branch():
    # branch times ~ work / threads: learner is critical, evaluator has slack
    work = {"learner": 0.4, "evaluator": 0.1}

    def times(q):
        return {c: work[c] / q[c] for c in work}

    def measure(q):
        return max(times(q).values())

    def regions(q):
        t = times(q)
        return [ForkJoin("tail", (Branch("L", ("learner",), t["learner"]), Branch("E", ("evaluator",), t["evaluator"])))]

    res = SlackQuotaManager(measure, regions, total=4, accept_margin=0.02).optimize({"learner": 1, "evaluator": 3})
    assert res.quotas["learner"] > 1 and res.quotas["evaluator"] < 3
    assert all(s.receiver == "learner" for s in res.steps if s.kept)
    fj = regions(res.quotas)[0]
    assert fj.slack()[fj.critical().name] == 0.0


def test_mps_quota_is_a_launch_environment_and_validated():
    assert mps_environment({}) == {}
    assert mps_environment({"policy": 40, "learner": 60}) == {MPS_ENV: "40"}
    with pytest.raises(ValueError, match="1..100"):
        mps_environment({"policy": 0})


def _env_probe(state, idx, inp):
    return {"seen": os.environ.get(MPS_ENV, ""), "threads": torch.get_num_threads()}


def _probe_component(ctx: BuildContext) -> None:
    return None


def test_process_worker_gets_its_quota_at_launch():
    wf = Workflow("probe", (Component("gpuish", _probe_component),), (StateSpec("seen"), StateSpec("threads")), {},
                  (OpSpec("probe", "gpuish", _env_probe, writes=("seen@iteration", "threads@iteration")),))
    plan = Plan("p", (WorkerSpec("w", ("gpuish",), kind="process"),), gpu_percent={"gpuish": 30},
                threads={"gpuish": 1})
    res = execute(wf, plan, SchedulerConfig(), None, range(1), record=("seen", "threads"))
    values = {k.state: v for k, v in res.records.items()}
    assert values == {"seen": "30", "threads": 1}
    assert MPS_ENV not in os.environ  # the parent's environment is untouched


def _parent_probe(state, idx, inp):
    return {"parent": os.getppid()}


def test_process_workers_come_from_the_fork_server_unless_they_need_their_own_environment():
    """A worker without an MPS quota is forked by the fork server (torch already imported there, so
    it starts in a fraction of a second); one with a quota is spawned by this process, with the
    quota in its environment at launch (the fork server's children inherit the server's)."""
    wf = Workflow("probe", (Component("c", _probe_component),), (StateSpec("parent"),), {},
                  (OpSpec("probe", "c", _parent_probe, writes=("parent@iteration",)),))
    seen = {}
    for name, quota in (("forked", {}), ("spawned", {"c": 30})):
        plan = Plan(name, (WorkerSpec("w", ("c",), kind="process"),), gpu_percent=quota)
        res = execute(wf, plan, SchedulerConfig(), None, range(1), record=("parent",))
        seen[name] = next(iter(res.records.values()))
    assert seen["spawned"] == os.getpid()
    assert seen["forked"] != os.getpid()  # the fork server's child


def test_thread_quota_is_per_worker_thread():
    seen: dict[str, int] = {}

    def worker() -> None:
        set_worker_threads(1)
        seen["worker"] = torch.get_num_threads()

    before = torch.get_num_threads()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == 1
    assert torch.get_num_threads() == before


def test_gpu_telemetry_degrades_cleanly_without_a_gpu():
    tel = GpuTelemetry()
    if tel.available:  # pragma: no cover - exercised by benchmarks/gpu_check.sh on a GPU machine
        pytest.skip("a GPU is present: the fallback path is for CPU-only machines")
    assert "NVML" in tel.reason or "nvml" in tel.reason.lower()
    assert tel.sample() is None
    timer = OpTimer()
    assert timer.backend == ("cuda-events" if torch.cuda.is_available() else "perf_counter")
    got: list[float] = []
    with timer.time(got.append):
        time.sleep(0.002)
    assert got and got[0] > 0
    with ActivitySampler(0.002, time.perf_counter(), tel) as sampler:
        sum(i * i for i in range(200_000))
        deadline = time.perf_counter() + 5.0  # on a loaded machine the sampler thread may not have run yet
        while not sampler.samples and time.perf_counter() < deadline:
            time.sleep(0.005)
    assert sampler.samples and all(s.gpu_util is None for s in sampler.samples)
    assert all(s.process_cores >= 0 for s in sampler.samples)


def test_sm_model_is_labelled_and_rose_helps_on_it():
    st = study(SmModelParams(steps=16), sweep=False)
    assert "MODEL" in st.label and st.label == LABEL
    by = {r.name: r for r in st.runs}
    assert by["planner+rose"].env_steps_per_s >= by["coarse-pipeline(m=2)"].env_steps_per_s
    assert by["planner+rose"].sm_activity > by["sequential"].sm_activity
    assert all(0.0 <= r.sm_activity <= 1.0 for r in st.runs)


def test_thread_slowdown_is_fitted_from_overlapping_spans():
    from components.scheduler.planner import thread_slowdown

    alone = {"a": 0.010, "b": 0.010}
    # worker x runs a alone (10 ms), then b overlapped by worker y's a: both stretched by kappa = 1.8
    spans = [Span("a", "a", "c", "x", 1, 0.000, 0.010, 1), Span("b", "b", "c", "x", 1, 0.010, 0.028, 1),
             Span("a", "a", "d", "y", 1, 0.010, 0.028, 1)]
    assert thread_slowdown(spans, alone) == pytest.approx(1.8)
    assert thread_slowdown(spans[:1], alone) == 1.0  # nothing overlapped: no evidence, no slowdown


def test_replay_charges_thread_contention_and_the_capacity_it_is_given():
    from components.scheduler.executor import plan_workflow
    from components.scheduler.graph import build_graph
    from components.scheduler.simulate import simulate

    wf = synthetic_workflow(SPEC, groups=1)
    durations = {"retrieve": 0.0, "sync": 0.0, "reset": 0.0, "infer": 0.0, "env_step": 0.0, "advantage": 0.0,
                 "learn": 0.010, "eval": 0.010}
    threads = Plan("side-thread", (WorkerSpec("main", ("sim", "policy", "learner", "retriever")),
                                   WorkerSpec("side", ("evaluator",))), default_threads=1)
    process = threads.with_(name="side-process", workers=(threads.workers[0], WorkerSpec("side", ("evaluator",), kind="process")))
    g = build_graph(plan_workflow(wf, threads), range(3), {})

    def run(plan: Plan, capacity: float, kappa: float) -> float:
        return simulate(g, plan, lambda i, t: durations[i.name], lambda i, t: 1.0, capacity, thread_slowdown=kappa).iteration

    assert run(process, 2.0, 2.0) == pytest.approx(0.010)  # learn and eval overlap on two cores
    assert run(threads, 2.0, 2.0) == pytest.approx(0.020)  # kappa = 2: threads give no overlap
    assert run(process, 1.0, 1.0) == pytest.approx(0.020)  # one effective core: no overlap either


def test_effective_cores_is_between_one_and_the_core_count():
    from components.scheduler.profiler import effective_cores

    assert 1.0 <= effective_cores(2, seconds=0.05) <= 2.0
    assert effective_cores(1) == 1.0


# ------------------------------------------------------------------ planning on a qualified capacity reading
class _FakeProbe:
    """Capacity readings in a fixed order (what a host stealing a core, then giving it back, reads)."""

    def __init__(self, readings: list[float]) -> None:
        self.readings = list(readings)
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.readings.pop(0)


def test_capacity_is_reprobed_until_a_reading_qualifies():
    from components.scheduler.profiler import qualified_capacity

    probe, waits = _FakeProbe([1.02, 1.4, 1.95, 2.0]), []
    reading = qualified_capacity(probe, devices=2, fraction=0.9, attempts=5, wait_s=2.0, sleep=waits.append)
    assert reading.qualified and reading.cores == 1.95
    assert reading.readings == (1.02, 1.4, 1.95) and probe.calls == 3  # stops at the first qualified reading
    assert waits == [2.0, 2.0]  # a wait between probes, none before the first
    assert "qualified capacity reading: 1.95" in reading.note()


def test_capacity_never_qualifying_plans_on_the_best_reading_and_says_so():
    from components.scheduler.profiler import qualified_capacity

    probe, waits = _FakeProbe([1.02, 1.5, 1.1]), []
    reading = qualified_capacity(probe, devices=2, fraction=0.9, attempts=3, wait_s=0.5, sleep=waits.append)
    assert not reading.qualified and reading.cores == 1.5 and reading.needed == pytest.approx(1.8)
    assert probe.calls == 3 and waits == [0.5, 0.5]  # bounded: attempts, no more
    assert "UNQUALIFIED" in reading.note() and "1.50" in reading.note()
    first = qualified_capacity(_FakeProbe([2.0]), devices=2, fraction=0.9, attempts=3, wait_s=1.0, sleep=waits.append)
    assert first.qualified and first.readings == (2.0,) and waits == [0.5, 0.5]  # qualified at once: no wait


# ------------------------------------------------------------------ process IPC in the cost model
def test_fit_ipc_recovers_latency_and_per_byte_cost_from_per_op_medians():
    from components.scheduler.costmodel import fit_ipc

    latency, per_byte = 2e-4, 1e-9
    samples = []
    for op, nbytes in (("infer", 10_000), ("env_step", 50_000), ("learn", 400_000)):
        for direction in ("in", "out"):
            samples += [(op, direction, nbytes, latency + nbytes * per_byte)] * 4
            samples.append((op, direction, nbytes, 0.5))  # one crossing that waited for a busy core
    ipc = fit_ipc(samples, rows={"infer": 100.0, "env_step": 100.0, "learn": 1.0})
    assert ipc.latency_s == pytest.approx(latency, rel=1e-6) and ipc.s_per_byte == pytest.approx(per_byte, rel=1e-6)
    assert ipc.out_bytes("infer", 50.0) == pytest.approx(5_000)  # bytes scale with the rows an op processes
    assert ipc.out_bytes("unknown", 10.0) == 0.0
    with pytest.raises(ValueError, match="process worker"):
        fit_ipc([], rows={})


def test_fit_ipc_keeps_the_line_when_one_crossing_always_waited_for_a_busy_core():
    """A whole (op, direction) whose median crossing waited (a loaded host) must not set the line:
    least squares through these points gave latency 0 and ~20x the per-byte cost."""
    from components.scheduler.costmodel import fit_ipc

    latency, per_byte = 4.5e-4, 5.6e-9
    sizes = {"sample": 20_000, "infer": 60_000, "env_step": 150_000, "learn": 400_000, "validate": 900_000}
    samples = [(op, "out", n, latency + n * per_byte) for op, n in sizes.items() for _ in range(3)]
    samples += [("validate", "in", 900_000, 0.05)] * 3  # always behind a busy core
    ipc = fit_ipc(samples, rows=dict.fromkeys(sizes, 1.0))
    assert ipc.s_per_byte == pytest.approx(per_byte, rel=0.05) and ipc.latency_s == pytest.approx(latency, rel=0.05)


def test_replay_charges_pipe_crossings_to_process_workers_only():
    from components.scheduler.costmodel import IpcCost
    from components.scheduler.executor import plan_workflow
    from components.scheduler.graph import build_graph
    from components.scheduler.simulate import simulate, transfer_seconds

    wf = synthetic_workflow(SPEC, groups=1)
    threads = Plan("side-thread", (WorkerSpec("main", ("sim", "policy", "learner", "retriever")),
                                   WorkerSpec("side", ("evaluator",))), default_threads=1)
    process = threads.with_(name="side-process",
                            workers=(threads.workers[0], WorkerSpec("side", ("evaluator",), kind="process")))
    g = build_graph(plan_workflow(wf, process), range(3), {})
    ipc = IpcCost(latency_s=0.001, s_per_byte=0.0, out_bytes_per_row={})
    assert transfer_seconds(g, threads, ipc, lambda op: 0.0) == {}
    costs = transfer_seconds(g, process, ipc, lambda op: 0.0)
    evals = [i.uid for i in g.instances if i.name == "eval"]
    assert set(costs) == set(evals)  # only the evaluator's ops cross a pipe
    # each eval returns its result (one message) and receives the weights made by the learner on
    # another worker once (a second message), except where it reads only graph inputs
    assert all(costs[u] in (pytest.approx(0.001), pytest.approx(0.002)) for u in evals)
    assert any(costs[u] == pytest.approx(0.002) for u in evals)
    durations = {"learn": 0.010, "eval": 0.010}

    def run(transfer: dict[int, float] | None) -> float:
        return simulate(g, process, lambda i, t: durations.get(i.name, 0.0), lambda i, t: 1.0, 2.0,
                        transfer=transfer).iteration

    assert run(costs) > run(None)  # priced crossings lengthen the process plan's replay
