"""The embedded scheduler side by side with its baselines, on the PPO iteration (and FERT's).

    python -m benchmarks.scheduler            # 256 envs x 64 steps, ~6-10 min on 2 shared cores
    python -m benchmarks.scheduler --quick    # 64 envs x 16 steps, smoke run (~1-2 min)

Schedules of the *same* workflow (results are checked bit for bit against the sequential one):

1. sequential, library-default threads (torch and BLAS pools as they come);
2. sequential, hand-tuned (BLAS 1 thread, torch = cores) — the honest sequential baseline;
3. RLinf-style coarse pipelining: env | rollout in 2 stages on separate cores, actor after on all
   cores, same thread tuning as (2);
4. the M2Flow planner's plan (profile → cost curves → cut search over placement × split × m);
5. planner + Rose (window-guided rewrites, validated end to end) + slack-aware thread quotas.

Reported: iteration time and env-steps/s (medians over interleaved rounds), the gain of each
stage (quotas, pipelining/placement, graph rewrites), planner regret against brute force over
its candidate plans, predicted-vs-measured error, a Gantt + activity PNG before/after, the FERT
iteration (sequential vs planner + Rose), and the SM model study (labelled: a model, not a GPU).
The machine is shared: the load (our cores and the whole machine's, sampled) is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from components.config import PolicyConfig, load_settings
from components.scheduler.gantt import plot_timelines
from components.scheduler.plan import Plan, WorkerSpec
from components.scheduler.profiler import GpuTelemetry, OpTimer
from components.scheduler.sm_model import LABEL as SM_LABEL
from components.scheduler.sm_model import study
from components.training.workloads.fert_iteration import FertIterSpec, build_fert_data, fert_runtime
from components.training.workloads.ppo import PPOSpec, ppo_runtime

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "scheduler"


def log(msg: str) -> None:
    print(msg, flush=True)


def load() -> dict[str, float]:
    one, five, _ = os.getloadavg()
    return {"loadavg_1m": one, "loadavg_5m": five}


def interleaved(rt: Any, plans: list[Plan], iterations: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Run every plan ``rounds`` times in turn (A B C A B C ...); iteration 0 of each run is warm-up."""
    out: dict[str, dict[str, Any]] = {p.name: {"samples": [], "digests": set(), "process_cores": [],
                                               "machine_cores": []} for p in plans}
    for r in range(rounds):
        for p in plans:
            res = rt.run(p, iterations + 1)
            o = out[p.name]
            o["samples"] += res.iteration_s[1:]
            o["digests"].add(tuple(v["digest"] if isinstance(v, dict) and "digest" in v else repr(v.get("loss"))
                                   for k, v in sorted(res.records.items()) if k.state == "stats"))
            o["process_cores"].append(res.timeline.mean_process_cores())
            o["machine_cores"].append(res.timeline.mean_machine_cores())
            o["last"] = res
            log(f"  round {r + 1}/{rounds} {p.name:<44} median {statistics.median(res.iteration_s[1:]) * 1e3:8.1f} ms")
    for o in out.values():
        o["median_s"] = statistics.median(o["samples"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke version")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the PPO models run; cuda adds one CUDA stream per worker (gpu_check.sh)")
    ap.add_argument("--mps-eval", type=int, default=0, metavar="PCT",
                    help="run the evaluator as an MPS client process with this SM percentage (GPU only)")
    ap.add_argument("--name", default=NAME, help="results file stem (benchmarks/results/NAME.json/.png)")
    args = ap.parse_args()
    quick = args.quick
    name = args.name
    s = load_settings()
    cfg = s.scheduler
    envs, steps = (64, 16) if quick else (256, 64)
    iterations, rounds = (2, 1) if quick else (3, 3)
    started = time.time()
    load_start = load()
    gpu = GpuTelemetry() if cfg.gpu_telemetry else None
    log(f"scheduler benchmark ({'quick' if quick else 'full'}): PPO {envs} envs x {steps} steps, "
        f"{os.cpu_count()} cores, load {load_start}")
    log(f"GPU telemetry: {'available' if gpu and gpu.available else 'unavailable (' + (gpu.reason if gpu else 'off') + ')'}"
        f"; op timer: {OpTimer().backend}")

    # a small actor-critic (2 x 128) as embodied RL uses; inference in fixed 1/4-batch chunks
    policy = PolicyConfig(hidden=128, layers=2)
    spec = PPOSpec(sim=s.sim, policy=policy, robot_ids=tuple(s.fleet.robot_ids(envs)),
                   eval_robot_ids=tuple(s.fleet.heldout_ids(16 if quick else 32)), steps=steps,
                   eval_steps=steps, infer_chunk=envs // max(cfg.pipeline_stages), seed=s.seed, device=args.device)
    rt = ppo_runtime(spec, cfg, log=log, gpu=gpu)

    # ---- plans
    t = time.time()
    seq_default, coarse = rt.sequential(tuned=False), rt.coarse()
    seq_tuned_all = [rt.sequential(tuned=True, threads=t) for t in sorted({1, rt.devices})]
    log("profiling the sequential schedule at each stage count and thread count ...")
    planned = rt.plan()
    log(planned.table())
    planner_plan = planned.best.plan
    log(f"planner done in {time.time() - t:.1f} s; Rose + quotas ...")
    t = time.time()
    if args.device == "cuda":
        planner_plan = planner_plan.with_(cuda_streams=True)
        coarse = coarse.with_(cuda_streams=True)
    opt = rt.optimize(planner_plan)
    rose_plan = opt.plan
    if args.mps_eval:
        rose_plan = _evaluator_as_mps_client(rose_plan, args.mps_eval)
    log(rose_plan.describe())
    log(f"Rose done in {time.time() - t:.1f} s")

    # ---- side by side
    log("side-by-side measurement (interleaved rounds):")
    plans = [seq_default, *seq_tuned_all, coarse, planner_plan, rose_plan]
    meas = interleaved(rt, plans, iterations, rounds)
    med = {p.name: meas[p.name]["median_s"] for p in plans}
    # hand-tuned sequential = the better thread setting, as measured side by side in this run
    seq_tuned = min(seq_tuned_all, key=lambda p: med[p.name])
    digests = {p.name: sorted(meas[p.name]["digests"]) for p in plans}
    identical = len({tuple(map(tuple, d)) for d in digests.values()}) == 1 and all(len(d) == 1 for d in digests.values())

    # ---- planner: regret against brute force, prediction error
    log("brute force over the planner's candidate plans ...")
    cands = sorted(planned.candidates, key=lambda c: c.predicted_s)[: (4 if quick else 8)]
    if planned.best not in cands:
        cands.append(planned.best)
    bf = interleaved(rt, [c.plan.with_(name=f"cand{k}:{c.plan.name}:{c.tree.describe()}") for k, c in enumerate(cands)],
                     iterations, 1)
    bf_rows = []
    for k, c in enumerate(cands):
        m = bf[f"cand{k}:{c.plan.name}:{c.tree.describe()}"]["median_s"]
        replay = rt.predict(c.plan)
        bf_rows.append({"stages": c.stages, "placement": c.tree.describe(), "predicted_ms": c.predicted_s * 1e3,
                        "replay_predicted_ms": replay * 1e3, "measured_ms": m * 1e3,
                        "error": abs(c.predicted_s - m) / m, "replay_error": abs(replay - m) / m,
                        "chosen": c is planned.best})
    best_measured = min(r["measured_ms"] for r in bf_rows)
    chosen_row = next(r for r in bf_rows if r["chosen"])
    regret = chosen_row["measured_ms"] / best_measured - 1.0
    pred_err = abs(planner_plan.predicted_s - med[planner_plan.name]) / med[planner_plan.name]

    # ---- FERT iteration through the scheduler
    log("FERT iteration: sequential vs planner + Rose ...")
    with tempfile.TemporaryDirectory() as tmp:
        data = build_fert_data(Path(tmp), s.sim, s.store, s.fert, s.policy, s.fleet.robot_ids(8 if quick else 16),
                               2, batch_size=512 if quick else 2048, seed=s.seed)
        fspec = FertIterSpec(sim=s.sim, policy=s.policy, eval_robot_ids=tuple(s.fleet.heldout_ids(16 if quick else 32)),
                             hooks=data.hooks, window=s.store.window, eval_steps=40 if quick else 80, seed=s.seed)
        frt = fert_runtime(fspec, data, cfg, log=log)
        f_seq = frt.sequential(True)
        f_plan = frt.plan().best.plan
        f_rose = frt.optimize(f_plan).plan
        fmeas = interleaved(frt, [f_seq, f_plan, f_rose], iterations + 1, rounds)
    fert = {p.name: {"median_ms": fmeas[p.name]["median_s"] * 1e3} for p in (f_seq, f_plan, f_rose)}
    fert_identical = len({tuple(fmeas[p.name]["digests"]) for p in (f_seq, f_plan, f_rose)}) == 1
    fert_speedup = fmeas[f_seq.name]["median_s"] / fmeas[f_rose.name]["median_s"]

    # ---- SM model
    log(f"{SM_LABEL}: four schedules + sensitivity sweep ...")
    sm = study(sweep=not quick)

    # ---- report
    def ratio(a: str, b: str) -> float:
        return med[a] / med[b]

    env_steps = envs * steps
    summary = {
        "iteration_ms": {k: v * 1e3 for k, v in med.items()},
        "env_steps_per_s": {k: env_steps / v for k, v in med.items()},
        "speedup_vs_sequential_default": ratio(seq_default.name, rose_plan.name),
        "speedup_vs_sequential_tuned": ratio(seq_tuned.name, rose_plan.name),
        "best_hand_tuned_sequential": seq_tuned.name,
        "speedup_vs_coarse_pipelining": ratio(coarse.name, rose_plan.name),
        "attribution": {
            "thread_quotas (sequential default -> best hand-tuned)": ratio(seq_default.name, seq_tuned.name),
            "placement + pipelining (tuned sequential -> planner)": ratio(seq_tuned.name, planner_plan.name),
            "graph rewrites + slack quotas (planner -> planner+Rose)": ratio(planner_plan.name, rose_plan.name),
            "coarse pipelining vs tuned sequential": ratio(seq_tuned.name, coarse.name),
        },
        "planner": {"plan": planner_plan.describe(), "predicted_ms": planner_plan.predicted_s * 1e3,
                    "measured_ms": med[planner_plan.name] * 1e3, "prediction_error": pred_err,
                    "regret_vs_brute_force": regret, "candidates": bf_rows,
                    "mean_abs_error_all_candidates": statistics.fmean(r["error"] for r in bf_rows),
                    "mean_abs_replay_error_all_candidates": statistics.fmean(r["replay_error"] for r in bf_rows)},
        "rose": {"plan": rose_plan.describe(), "report": opt.rose.report(),
                 "windows_ms": [(w.start * 1e3, w.end * 1e3, w.busy_cores) for w in opt.rose.windows],
                 "decisions": [asdict(d) for d in opt.rose.decisions],
                 "quota_steps": [asdict(q) for q in (opt.quotas.steps if opt.quotas else [])]},
        "bit_identical_across_plans": identical,
        "digests": {k: [list(x) for x in v] for k, v in digests.items()},
        "fert_iteration": {"median_ms": fert, "speedup_rose_vs_sequential": fert_speedup,
                           "bit_identical": fert_identical, "plan": f_rose.describe()},
        "sm_model": {"label": sm.label, "params": asdict(sm.params),
                     "runs": [{"name": r.name, "iteration_ms": r.iteration_s * 1e3, "env_steps_per_s": r.env_steps_per_s,
                               "sm_activity": r.sm_activity} for r in sm.runs],
                     "notes": sm.notes, "sensitivity": sm.sweep},
        "load": {"start": load_start, "end": load(),
                 "process_cores_mean": {p.name: statistics.fmean(meas[p.name]["process_cores"]) for p in plans},
                 "machine_cores_mean": {p.name: statistics.fmean(meas[p.name]["machine_cores"]) for p in plans}},
        "targets": {
            ">=1.5x over sequential (default threads)": ratio(seq_default.name, rose_plan.name) >= 1.5,
            ">=1.5x over sequential (best hand-tuned)": ratio(seq_tuned.name, rose_plan.name) >= 1.5,
            ">=1.15x over coarse pipelining": ratio(coarse.name, rose_plan.name) >= 1.15,
            "prediction error <= 15%": pred_err <= 0.15,
        },
        "config": {"envs": envs, "steps": steps, "iterations_per_run": iterations, "rounds": rounds, "quick": quick,
                   "python": platform.python_version(), "cores": os.cpu_count(),
                   "gpu_telemetry": "available" if gpu and gpu.available else (gpu.reason if gpu else "off")},
        "seconds": time.time() - started,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    last = iterations  # plot the last iteration of each run
    plot_timelines([(f"{seq_tuned.name} {med[seq_tuned.name] * 1e3:.0f} ms", meas[seq_tuned.name]["last"].timeline),
                    (f"coarse pipelining {med[coarse.name] * 1e3:.0f} ms", meas[coarse.name]["last"].timeline),
                    (f"planner + Rose {med[rose_plan.name] * 1e3:.0f} ms", meas[rose_plan.name]["last"].timeline)],
                   RESULTS / f"{name}.png", capacity=float(rt.devices), iterations=(last, last))
    _plot_sm(sm, RESULTS / f"{name}_sm_model.png")
    log(json.dumps({k: summary[k] for k in ("iteration_ms", "attribution", "targets")}, indent=2))
    log(f"planner prediction error {pred_err:.1%}, regret {regret:.1%}; FERT speedup {fert_speedup:.2f}x; "
        f"bit-identical {identical}/{fert_identical}; {summary['seconds']:.0f} s; wrote {RESULTS / name}.json/.png")


def _evaluator_as_mps_client(plan: Plan, percent: int) -> Plan:
    """The evaluator in its own process, launched with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=percent."""
    workers = [w.__class__(w.name, tuple(c for c in w.components if c != "evaluator"), w.kind, w.cores)
               for w in plan.workers]
    workers = [w for w in workers if w.components]
    workers.append(WorkerSpec("eval-mps", ("evaluator",), kind="process"))
    return plan.with_(name=f"{plan.name}+mps-eval{percent}", workers=tuple(workers),
                      gpu_percent={**plan.gpu_percent, "evaluator": percent})


def _plot_sm(sm: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if sm.sweep else 2, figsize=(13 if sm.sweep else 9, 3.8))
    names = [r.name for r in sm.runs]
    axes[0].bar(names, [r.env_steps_per_s / 1e3 for r in sm.runs], color="#4e79a7")
    axes[0].set_ylabel("k env-steps/s (modelled)")
    axes[1].bar(names, [r.sm_activity for r in sm.runs], color="#f28e2b")
    axes[1].set_ylabel("SM activity (modelled)")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=20, labelsize=7)
    if sm.sweep:
        for scale in sorted({r["cap_scale"] for r in sm.sweep}):
            rows = [r for r in sm.sweep if r["cap_scale"] == scale]
            axes[2].plot([r["interference"] for r in rows], [r["throughput_gain_vs_coarse"] for r in rows], marker="o",
                         label=f"parallelism cap x{scale}")
        axes[2].set_xlabel("interference")
        axes[2].set_ylabel("Rose / coarse throughput")
        axes[2].legend(fontsize=7)
    fig.suptitle(sm.label, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
