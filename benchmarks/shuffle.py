"""FUSCO fused shuffle vs the Megatron-style dispatcher, side by side, on gloo.

    python -m benchmarks.shuffle            # full grid, 4 and 8 processes (~10 min on 2 cores)
    python -m benchmarks.shuffle --quick    # smoke version (~1 min)

Per configuration, in one process group and on the same routing: warm-up, then ABAB... pairs of
(megatron, fused) calls -- forward dispatch + identity experts + combine, each call timed as the
slowest rank (all-reduce MAX); the pair order alternates. We quote the median of the per-pair
ratios megatron / fused (and their min..max) and the median times. The number of pairs adapts to
the call time (``PAIR_BUDGET_S``, between ``MIN_PAIRS`` and ``MAX_PAIRS``; fast top-1 configurations,
whose median ratio carries the 0.95x target, get ``TOP1_PAIR_BUDGET_S`` up to ``TOP1_MAX_PAIRS``),
identically on every rank. "fused" is the production path: ``ShuffleConfig()`` defaults, plan auto
(permute at top-1, rank_dedup otherwise on one host). Bytes are the row payload this rank sends to other ranks (dispatch +
combine), averaged over ranks, total and inter-node; the fused path's per-pair metadata is
counted separately (``side_mib``); "passes" = bytes written by local copies / bytes of the
T*K*H pair rows. Two-level inter-node bytes come from its plan (not timed). On small configs
(<= ``STUDY_MAX`` pair elements, 4 ranks) the study variants -- fused_one_level (the pair-level engine, no
dedup: the copies-only win), fused_rank_dedup (auto's top-k > 1 path, also at top-1), fused_two_level
and dedup_permute -- are timed too (unpaired, 3
calls). The end-to-end part trains the MoE policy on 4 ranks with megatron, fused and fused
two-level models in one process group, stepping them in rotation. Load averages (start, end)
are recorded. Writes benchmarks/results/shuffle.{json,png}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from components.config import PolicyConfig, ShuffleConfig, TrainConfig
from components.shuffle.dispatchers import make_dispatcher
from components.shuffle.local_group import run_local_group
from components.shuffle.plan import build_plan
from components.shuffle.rank_dedup import STAT_FIELDS, routing_stats
from components.shuffle.routing import Placement, Routing, synthetic_routing

RESULTS = Path(__file__).resolve().parent / "results"
NODES = 2  # ranks are split into 2 "nodes" (W/2 ranks each)
BASELINE, FUSED = "megatron", "fused"
PAIRED = {BASELINE: ShuffleConfig(dispatcher="megatron"), FUSED: ShuffleConfig()}
STUDY = {
    "fused_one_level": ShuffleConfig(plan="one_level"),
    "fused_rank_dedup": ShuffleConfig(plan="rank_dedup"),
    "fused_two_level": ShuffleConfig(plan="two_level"),
    "dedup_permute": ShuffleConfig(dispatcher="dedup_permute"),
}
STUDY_MAX = 2 * 2**20  # pair elements (T*K*H) per rank up to which the study variants are timed
STUDY_WORLDS = (4,)
STUDY_CALLS = 3
BIG = 8 * 2**20  # from here the warm-up is one fused call only (Megatron allocates fresh buffers anyway)
PAIR_BUDGET_S = 2.5  # seconds of timed pairs per configuration
MIN_PAIRS, MAX_PAIRS = 2, 25  # the fast (noisiest) configurations get the most pairs
TOP1_FAST_S = 0.030  # top-1 configurations with calls under this get the larger budget below
TOP1_PAIR_BUDGET_S, TOP1_MAX_PAIRS = 4.0, 60  # their median ratio carries the >= 0.95x target


@dataclass(frozen=True)
class Config:
    tokens: int  # per rank
    hidden: int
    top_k: int
    experts: int
    routing: str


def grid(quick: bool) -> list[Config]:
    if quick:
        return [Config(256, 64, k, 16, r) for k in (1, 8) for r in ("uniform", "node_confined")]
    main = [Config(t, h, k, e, r) for r, e, k, t, h in itertools.product(
        ("uniform", "node_confined", "zipf"), (16, 64), (2, 8), (1024, 4096), (256, 1024))]
    top1 = [Config(t, h, 1, e, "uniform") for e in (16, 64) for t in (1024, 4096) for h in (256, 1024)]
    return main + top1


def _timed(disp, x: torch.Tensor, routing: Routing, group) -> float:
    disp.transport.meter.reset()
    dist.barrier(group)
    start = time.perf_counter()
    d = disp.dispatch(x, routing)
    disp.combine(d.x, d.handle)  # identity experts
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def _meter_row(disp, world: int, group, pair_bytes: int) -> dict:
    m = disp.transport.meter
    v = torch.tensor([m.bytes_sent, m.bytes_internode, m.bytes_copied, m.bytes_side], dtype=torch.float64)
    dist.all_reduce(v, group=group)
    sent, inter, copied, side = (float(a) / world for a in v)
    return {"sent_mib": sent / 2**20, "internode_mib": inter / 2**20, "side_mib": side / 2**20,
            "copied_mib": copied / 2**20, "passes": copied / pair_bytes}


def _worker(rank: int, world: int, configs: list[Config]) -> list[dict]:
    torch.set_grad_enabled(False)
    group = dist.group.WORLD
    out = []
    for ci, c in enumerate(configs):
        placement = Placement(c.experts, world, world // NODES)
        g = torch.Generator().manual_seed(1000 * ci + rank)
        ids = synthetic_routing(c.routing, c.tokens, c.top_k, placement, g)
        routing = Routing(ids, torch.softmax(torch.randn(c.tokens, c.top_k, generator=g), dim=1))
        x = torch.randn(c.tokens, c.hidden, generator=g)
        stats = routing_stats(routing, placement, rank)
        dist.all_reduce(stats, group=group)
        st = dict(zip(STAT_FIELDS, (int(v) for v in stats.tolist())))
        disp = {name: make_dispatcher(placement, group, cfg) for name, cfg in PAIRED.items()}
        elems = c.tokens * c.top_k * c.hidden
        pair_bytes = elems * 4
        # warm-up (workspace page faults, allocator), then pairs in alternating order
        warm = [FUSED] if elems >= BIG else [BASELINE, FUSED]
        est = sum(_timed(disp[n], x, routing, group) for n in warm)
        times: dict[str, list[float]] = {BASELINE: [], FUSED: []}
        ratios: list[float] = []
        n_pairs = MIN_PAIRS if elems >= BIG else None
        i = 0
        while n_pairs is None or i < n_pairs:
            order = (BASELINE, FUSED) if i % 2 == 0 else (FUSED, BASELINE)
            t = {n: _timed(disp[n], x, routing, group) for n in order}
            for n in order:
                times[n].append(t[n])
            ratios.append(t[BASELINE] / t[FUSED])
            if n_pairs is None:  # same on every rank: the times are all-reduced maxima
                pair_s = max(t[BASELINE] + t[FUSED], 1e-6)
                budget, most = ((TOP1_PAIR_BUDGET_S, TOP1_MAX_PAIRS) if c.top_k == 1 and pair_s < 2 * TOP1_FAST_S
                                else (PAIR_BUDGET_S, MAX_PAIRS))
                n_pairs = int(min(most, max(MIN_PAIRS, budget // pair_s)))
            i += 1
        row = {"config": asdict(c), "world": world, "pairs": len(ratios), "warmup": warm,
               "plan": disp[FUSED].last_plan.kind, "stats": st,
               "node_dedup_factor": st["pairs_internode"] / max(st["node_rows_internode"], 1),
               "rank_dedup_factor": st["pairs_offrank"] / max(st["rank_rows"], 1),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "ratios": ratios, "variants": {}}
        for name in PAIRED:
            row["variants"][name] = {"median_ms": 1e3 * statistics.median(times[name]),
                                     "min_ms": 1e3 * min(times[name]), "max_ms": 1e3 * max(times[name]),
                                     "times_ms": [1e3 * v for v in times[name]],
                                     **_meter_row(disp[name], world, group, pair_bytes)}
        two = build_plan(routing, placement, rank, group, "two_level")
        inter2 = torch.tensor([two.token_stages[0].rows_sent(internode_only=True) * c.hidden * 4 * 2],
                              dtype=torch.float64)
        dist.all_reduce(inter2, group=group)
        row["two_level_internode_mib"] = float(inter2) / world / 2**20
        if elems <= STUDY_MAX and world in STUDY_WORLDS:
            for name, cfg in STUDY.items():
                d = make_dispatcher(placement, group, cfg)
                _timed(d, x, routing, group)
                ts = [_timed(d, x, routing, group) for _ in range(STUDY_CALLS)]
                row["variants"][name] = {"median_ms": 1e3 * statistics.median(ts), "times_ms": [1e3 * v for v in ts],
                                         **_meter_row(d, world, group, pair_bytes)}
        out.append(row)
        if rank == 0:
            _progress(ci + 1, len(configs), row)
        del disp
    return out


def _progress(i: int, n: int, row: dict) -> None:
    c, v = row["config"], row["variants"]
    study = " ".join(f"{k} x{v[BASELINE]['median_ms'] / v[k]['median_ms']:.2f}" for k in STUDY if k in v)
    print(f"[W={row['world']} {i}/{n}] T={c['tokens']} H={c['hidden']} K={c['top_k']} E={c['experts']} "
          f"{c['routing']:<13} megatron {v[BASELINE]['median_ms']:8.1f} ms | fused({row['plan']}) "
          f"{v[FUSED]['median_ms']:8.1f} ms | pair ratio x{row['ratio_median']:.2f} "
          f"[{row['ratio_min']:.2f}..{row['ratio_max']:.2f}] n={row['pairs']} | bytes "
          f"{v[BASELINE]['sent_mib']:.1f}->{v[FUSED]['sent_mib']:.1f} MiB {study}", flush=True)


# --------------------------------------------------------------------------------------------
# end to end: MoE policy training step, fused vs baseline shuffle, stepped in rotation


E2E_VARIANTS = {"megatron": ShuffleConfig(dispatcher="megatron"), "fused": ShuffleConfig(),
                "fused_two_level": ShuffleConfig(plan="two_level")}


def _e2e_worker(rank: int, world: int, policy: PolicyConfig, train: TrainConfig, steps: int, warmup: int) -> dict:
    from components.training.expert_parallel import ExpertParallelTrainer, _Data

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    states = rng.normal(size=(4096, 32)).astype(np.float32)
    data = _Data(torch.from_numpy(states), torch.from_numpy(np.tanh(states[:, :8]).astype(np.float32)), None)
    group = dist.group.WORLD
    trainers = {}
    for name, cfg in E2E_VARIANTS.items():
        trainers[name] = ExpertParallelTrainer(data, policy, train, cfg.model_copy(update={"ranks_per_node": world // NODES}),
                                               seed=0, group=group)
    names = list(trainers)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + steps):
        shift = i % len(names)
        for n in names[shift:] + names[:shift]:
            dist.barrier(group)
            loss, seconds = trainers[n].step()
            el = torch.tensor([seconds])
            dist.all_reduce(el, op=dist.ReduceOp.MAX, group=group)
            losses[n].append(loss)
            if i >= warmup:
                times[n].append(float(el))
    plans = {n: sorted({layer.dispatcher.last_plan.kind for layer in trainers[n].model.moe_layers()}
                       if hasattr(trainers[n].model, "moe_layers") else []) for n in names}
    return {"times": times, "losses": losses, "bytes": {n: trainers[n].shuffle_bytes_sent() for n in names},
            "plans": plans}


def end_to_end(world: int, steps: int, quick: bool) -> dict:
    policy = PolicyConfig(kind="moe_transformer", d_model=32 if quick else 128, heads=4, hidden=64 if quick else 256,
                          layers=2, num_experts=16, top_k=2 if quick else 8, history=16, aux_loss_weight=0.01)
    train = TrainConfig(batch_size=64 if quick else 256, epochs=1000, lr=1e-3)
    r = run_local_group(_e2e_worker, world, policy, train, steps, 2)[0]
    out: dict = {"world": world, "policy": policy.model_dump(), "batch_size": train.batch_size, "steps": steps,
                 "tokens_per_rank": train.batch_size // world * policy.history, "variants": {}}
    for name in E2E_VARIANTS:
        ts = r["times"][name]
        out["variants"][name] = {"median_step_ms": 1e3 * statistics.median(ts), "min_step_ms": 1e3 * min(ts),
                                 "max_step_ms": 1e3 * max(ts), "final_loss": r["losses"][name][-1],
                                 "sent_mib_rank0": r["bytes"][name] / 2**20}
        print(f"[e2e W={world}] {name}: median step {out['variants'][name]['median_step_ms']:.1f} ms "
              f"(loss {r['losses'][name][-1]:.4f})", flush=True)
    base = r["times"]["megatron"]
    out["step_ratios"] = {n: statistics.median([b / f for b, f in zip(base, r["times"][n])]) for n in E2E_VARIANTS}
    out["speedup"] = out["step_ratios"]["fused"]
    return out


# --------------------------------------------------------------------------------------------
# report


def summarize(rows: list[dict]) -> dict:
    def sel(routing: str | None, k: int) -> list[dict]:
        return [r for r in rows if r["config"]["top_k"] == k and (routing is None or r["config"]["routing"] == routing)]

    confined8 = [r["ratio_median"] for r in sel("node_confined", 8)]
    top1 = [r["ratio_median"] for r in sel(None, 1)]
    byte_checks = []
    for r in rows:
        st, v = r["stats"], r["variants"]
        base_total, base_inter = v[BASELINE]["sent_mib"], v[BASELINE]["internode_mib"]
        byte_checks.append({
            "config": r["config"], "world": r["world"],
            "rank_dedup_implied": st["pairs_offrank"] / max(st["rank_rows"], 1),
            "rank_dedup_measured": base_total / v[FUSED]["sent_mib"] if v[FUSED]["sent_mib"] else None,
            "internode_rank_dedup_implied": st["pairs_internode"] / max(st["rank_rows_internode"], 1),
            "internode_rank_dedup_measured": base_inter / v[FUSED]["internode_mib"] if v[FUSED]["internode_mib"] else None,
            "node_dedup_implied": r["node_dedup_factor"],
            "node_dedup_two_level_plan": base_inter / r["two_level_internode_mib"] if r["two_level_internode_mib"] else None,
        })

    def worst(key_m: str, key_i: str) -> float:
        errs = [abs(b[key_m] / b[key_i] - 1) for b in byte_checks if b[key_m] and b[key_i]]
        return max(errs) if errs else float("nan")

    study = {name: statistics.median([r["variants"][BASELINE]["median_ms"] / r["variants"][name]["median_ms"]
                                      for r in rows if name in r["variants"]])
             for name in STUDY if any(name in r["variants"] for r in rows)}
    return {
        "top1_ratio_min": min(top1) if top1 else None,
        "top1_ratio_median": statistics.median(top1) if top1 else None,
        "node_confined_top8_ratio_median": statistics.median(confined8) if confined8 else None,
        "node_confined_top8_ratio_min": min(confined8) if confined8 else None,
        "all_ratio_median": statistics.median(r["ratio_median"] for r in rows),
        "all_ratio_min": min(r["ratio_median"] for r in rows),
        "per_world": {w: {"top1_min": min([r["ratio_median"] for r in sel(None, 1) if r["world"] == w], default=None),
                          "node_confined_top8_median": statistics.median(
                              [r["ratio_median"] for r in sel("node_confined", 8) if r["world"] == w] or [float("nan")])}
                      for w in sorted({r["world"] for r in rows})},
        "plans_chosen": sorted({r["plan"] for r in rows}),
        "passes_median": {n: statistics.median(r["variants"][n]["passes"] for r in rows) for n in (BASELINE, FUSED)},
        "bytes_max_rel_error": {"rank_dedup_total": worst("rank_dedup_measured", "rank_dedup_implied"),
                                "rank_dedup_internode": worst("internode_rank_dedup_measured", "internode_rank_dedup_implied"),
                                "two_level_internode": worst("node_dedup_two_level_plan", "node_dedup_implied")},
        "study_median_ratio_small_configs": study,
        "bytes": byte_checks,
        "targets": {"node_confined_top8": ">= 1.5x (median)", "top1": ">= 0.95x (min)",
                    "bytes": "reduced by the dedup factor"},
    }


def plot(rows: list[dict], e2e: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    for world, marker in ((4, "o"), (8, "s")):
        for routing, color in (("uniform", "C0"), ("node_confined", "C1"), ("zipf", "C2")):
            for k, fill in ((1, "none"), (2, color), (8, color)):
                sel = [r for r in rows if r["world"] == world and r["config"]["routing"] == routing
                       and r["config"]["top_k"] == k]
                if not sel:
                    continue
                x = [r["config"]["tokens"] * r["config"]["top_k"] * r["config"]["hidden"] for r in sel]
                y = [r["ratio_median"] for r in sel]
                err = [np.subtract(y, [r["ratio_min"] for r in sel]), np.subtract([r["ratio_max"] for r in sel], y)]
                ax.errorbar(x, y, yerr=err, fmt=marker, color=color, mfc=fill, alpha=0.75 if k == 8 else 0.45,
                            ms=7 if k == 8 else 5, capsize=2, label=f"W={world} {routing} top-{k}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.95, color="grey", lw=0.8, ls=":")
    ax.axhline(1.5, color="r", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("pair elements per rank (T*K*H)")
    ax.set_ylabel("Megatron time / fused time, median of ABAB pairs (bars: min..max)")
    ax.set_title("dispatch + combine, fused (auto) vs Megatron")
    ax.legend(fontsize=5, ncol=2)

    ax = axes[1]
    names = [FUSED] + list(STUDY)
    for i, name in enumerate(names):
        if name == FUSED:
            ys = [r["ratio_median"] for r in rows if r["config"]["tokens"] * r["config"]["top_k"] * r["config"]["hidden"] <= STUDY_MAX]
        else:
            ys = [r["variants"][BASELINE]["median_ms"] / r["variants"][name]["median_ms"] for r in rows if name in r["variants"]]
        if not ys:
            continue
        ax.scatter(np.full(len(ys), i) + np.random.default_rng(i).uniform(-0.2, 0.2, len(ys)), ys, s=10, alpha=0.6)
        ax.plot([i - 0.3, i + 0.3], [statistics.median(ys)] * 2, color="k")
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("speedup over Megatron (small configs)")
    ax.set_title("fused (auto: permute at top-1, else rank dedup) vs the study variants", fontsize=9)

    ax = axes[2]
    s = summarize(rows)["bytes"]
    for key_i, key_m, label in (("rank_dedup_implied", "rank_dedup_measured", "fused total bytes"),
                                ("node_dedup_implied", "node_dedup_two_level_plan", "two-level inter-node bytes")):
        pts = [(b[key_i], b[key_m]) for b in s if b[key_m]]
        if pts:
            ax.scatter(*zip(*pts), s=12, label=label)
    lim = max([max(b["rank_dedup_implied"], b["node_dedup_implied"]) for b in s] + [2]) * 1.05
    ax.plot([1, lim], [1, lim], "k--", lw=0.8)
    ax.set_xlabel("dedup factor implied by the routing")
    ax.set_ylabel("bytes: Megatron / fused")
    ax.legend(fontsize=8)
    title = "bytes vs dedup factor"
    if e2e:
        title += " | e2e step: " + ", ".join(f"W={e['world']} x{e['speedup']:.2f}" for e in e2e)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke grid")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--e2e-steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "shuffle.json")
    args = parser.parse_args(argv)
    configs = grid(args.quick)
    started = time.time()
    load_start = os.getloadavg()
    print(f"load average at start: {load_start}", flush=True)
    rows: list[dict] = []
    for world in args.worlds:
        print(f"== {len(configs)} configs on {world} gloo processes: warm-up + ABAB pairs (megatron, fused)", flush=True)
        rows += run_local_group(_worker, world, configs)[0]
    grid_s = time.time() - started
    e2e_steps = args.e2e_steps or (4 if args.quick else 10)
    e2e = [end_to_end(4, e2e_steps, args.quick)]
    load_end = os.getloadavg()
    report = {
        "command": "python -m benchmarks.shuffle" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "backend": "gloo", "nodes": NODES},
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "seconds": time.time() - started,
        "grid_seconds": grid_s,
        "summary": summarize(rows),
        "end_to_end": e2e,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, e2e, args.out.with_suffix(".png"))
    s = report["summary"]
    print(f"done in {report['seconds']:.0f} s (grid {grid_s:.0f} s) -> {args.out} (+ .png); "
          f"load {load_start} -> {load_end}")
    print(f"top-1 ratio min x{s['top1_ratio_min']:.2f} (median x{s['top1_ratio_median']:.2f}); node-confined top-8 "
          f"median x{s['node_confined_top8_ratio_median']:.2f}; plans {s['plans_chosen']}; e2e: "
          + ", ".join(f"W={e['world']} x{e['speedup']:.2f}" for e in e2e))


if __name__ == "__main__":
    main()
