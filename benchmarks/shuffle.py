"""FUSCO fused shuffle vs Megatron-style and DeepEP-like dispatchers, side by side, on gloo.

    python -m benchmarks.shuffle            # full grid, 4 and 8 processes (~15 min on 2 cores)
    python -m benchmarks.shuffle --quick    # smoke version

Every configuration runs every variant on the same routing, interleaved (the variant order
rotates each repetition), forward dispatch + identity experts + combine, each iteration timed
as the slowest rank (all-reduce MAX); we quote the median and the min..max spread. Bytes are the
row payload this rank sends to other ranks (dispatch + combine, plus the probabilities the fused
path ships), averaged over ranks; "passes" = bytes written by local copies (gathers, scatters,
permutes, weighting, reductions) / bytes of the T*K*H pair rows.

Variants: megatron (baseline), dedup_permute (node dedup, separate permutes), fused_one_level
(baseline's bytes, no permute copies), fused_two_level (node dedup, no permute copies),
fused_one_level_c4 (4 pipelined rounds). "fused" = what shuffle.plan=auto picks from the
routing's dedup factor. Writes benchmarks/results/shuffle.{json,png}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from components.config import PolicyConfig, ShuffleConfig, TrainConfig
from components.shuffle.dispatchers import make_dispatcher
from components.shuffle.local_group import run_local_group
from components.shuffle.plan import dedup_stats
from components.shuffle.routing import Placement, Routing, synthetic_routing

RESULTS = Path(__file__).resolve().parent / "results"
NODES = 2  # ranks are split into 2 "nodes" (W/2 ranks each)
DEDUP_THRESHOLD = ShuffleConfig().dedup_threshold
VARIANTS = {
    "megatron": ShuffleConfig(dispatcher="megatron"),
    "dedup_permute": ShuffleConfig(dispatcher="dedup_permute"),
    "fused_one_level": ShuffleConfig(plan="one_level"),
    "fused_two_level": ShuffleConfig(plan="two_level"),
    "fused_one_level_c4": ShuffleConfig(plan="one_level", chunks=4),  # pipelining study subset only
}
BASELINE = "megatron"
BIG = 8 * 2**20  # pair elements (T*K*H) per rank from which a config skips the warm-up repetition


def variants_for(c: Config) -> list[str]:
    names = [n for n in VARIANTS if n != "fused_one_level_c4"]
    if c.routing == "uniform" and c.experts == 16 and c.top_k > 1:  # overlap study: 8 configs per W
        names.append("fused_one_level_c4")
    return names


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
    top1 = [Config(t, h, 1, 16, "uniform") for t in (1024, 4096) for h in (256, 1024)]
    return main + top1


def _worker(rank: int, world: int, configs: list[Config], reps: int, warmup: int) -> list[dict]:
    torch.set_grad_enabled(False)
    group = dist.group.WORLD
    out = []
    for ci, c in enumerate(configs):
        placement = Placement(c.experts, world, world // NODES)
        g = torch.Generator().manual_seed(1000 * ci + rank)
        ids = synthetic_routing(c.routing, c.tokens, c.top_k, placement, g)
        routing = Routing(ids, torch.softmax(torch.randn(c.tokens, c.top_k, generator=g), dim=1))
        x = torch.randn(c.tokens, c.hidden, generator=g)
        stats = dedup_stats(routing, placement, rank, group)
        auto = "fused_two_level" if stats.factor >= DEDUP_THRESHOLD else "fused_one_level"
        names = variants_for(c)
        dispatchers = {name: make_dispatcher(placement, group, VARIANTS[name]) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        skip = 0 if c.tokens * c.top_k * c.hidden >= BIG else warmup
        for it in range(skip + reps):
            shift = it % len(names)
            for name in names[shift:] + names[:shift]:  # rotate the order every repetition
                disp = dispatchers[name]
                disp.transport.meter.reset()
                dist.barrier(group)
                start = time.perf_counter()
                d = disp.dispatch(x, routing)
                y = disp.combine(d.x, d.handle)  # identity experts
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                if it >= skip:
                    times[name].append(float(elapsed))
                del d, y
        pair_bytes = c.tokens * c.top_k * c.hidden * 4
        row = {"config": asdict(c), "world": world, "dedup_factor": stats.factor, "auto": auto, "warmup": skip,
               "variants": {}}
        for name, disp in dispatchers.items():
            m = disp.transport.meter
            meter = torch.tensor([m.bytes_sent, m.bytes_internode, m.bytes_copied, m.bytes_side],
                                 dtype=torch.float64)
            dist.all_reduce(meter, group=group)
            sent, inter, copied, prob_sent = (float(v) / world for v in meter)
            row["variants"][name] = {
                "median_ms": 1e3 * statistics.median(times[name]),
                "min_ms": 1e3 * min(times[name]),
                "max_ms": 1e3 * max(times[name]),
                "times_ms": [1e3 * t for t in times[name]],
                "sent_mib": sent / 2**20,  # token rows, dispatch + combine
                "prob_sent_mib": prob_sent / 2**20,  # fused: one fp32 probability per pair
                "internode_mib": inter / 2**20,
                "copied_mib": copied / 2**20,
                "passes": copied / pair_bytes,
            }
        out.append(row)
        if rank == 0:
            _progress(ci + 1, len(configs), row)
        del dispatchers
    return out


def _progress(i: int, n: int, row: dict) -> None:
    c, v = row["config"], row["variants"]
    base = v[BASELINE]["median_ms"]
    fused = v[row["auto"]]["median_ms"]
    print(f"[W={row['world']} {i}/{n}] T={c['tokens']} H={c['hidden']} K={c['top_k']} E={c['experts']} "
          f"{c['routing']:<13} megatron {base:8.1f} ms | fused({row['auto'][6:]}) {fused:8.1f} ms "
          f"x{base / fused:4.2f} | 1L x{base / v['fused_one_level']['median_ms']:4.2f} "
          f"2L x{base / v['fused_two_level']['median_ms']:4.2f} "
          f"dedup_permute x{base / v['dedup_permute']['median_ms']:4.2f}"
          + (f" c4 x{base / v['fused_one_level_c4']['median_ms']:4.2f}" if "fused_one_level_c4" in v else ""),
          flush=True)


# --------------------------------------------------------------------------------------------
# end to end: MoE policy training step, fused vs baseline shuffle


def end_to_end(world: int, steps: int, quick: bool) -> dict:
    from components.training.expert_parallel import launch_expert_parallel

    policy = PolicyConfig(kind="moe_transformer", d_model=32 if quick else 128, heads=4, hidden=64 if quick else 256,
                          layers=2, num_experts=16, top_k=8 if not quick else 2, context=16, aux_loss_weight=0.01)
    train = TrainConfig(batch_size=64 if quick else 256, epochs=1000, lr=1e-3)
    rng = np.random.default_rng(0)
    out: dict = {"world": world, "policy": policy.model_dump(), "batch_size": train.batch_size, "steps": steps,
                 "tokens_per_rank": train.batch_size // world * policy.context, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.npz"
        states = rng.normal(size=(4096, 32)).astype(np.float32)
        np.savez(data, states=states, actions=np.tanh(states[:, :8]).astype(np.float32))
        for name, plan in (("megatron", "auto"), ("fused", "auto"), ("fused_one_level", "one_level")):
            shuffle = ShuffleConfig(dispatcher="megatron" if name == "megatron" else "fused", plan=plan,
                                    ranks_per_node=world // NODES)
            r = launch_expert_parallel(data, Path(tmp) / f"{name}.pt", policy, train, shuffle, seed=0, nproc=world,
                                       max_steps=steps, timeout_s=900)
            tail = r.step_times_s[2:] or r.step_times_s  # skip warm-up steps
            out["variants"][name] = {"median_step_ms": 1e3 * float(np.median(tail)),
                                     "min_step_ms": 1e3 * min(tail), "max_step_ms": 1e3 * max(tail),
                                     "final_loss": r.losses[-1], "sent_mib_rank0": r.shuffle_bytes_sent / 2**20}
            print(f"[e2e W={world}] {name}: median step {out['variants'][name]['median_step_ms']:.1f} ms "
                  f"(loss {r.losses[-1]:.4f})", flush=True)
    base = out["variants"]["megatron"]["median_step_ms"]
    out["speedup"] = base / out["variants"]["fused"]["median_step_ms"]
    out["speedup_one_level"] = base / out["variants"]["fused_one_level"]["median_step_ms"]
    return out


# --------------------------------------------------------------------------------------------
# report


def summarize(rows: list[dict]) -> dict:
    def ratio(r: dict, name: str) -> float:
        return r["variants"][BASELINE]["median_ms"] / r["variants"][name]["median_ms"]

    confined8 = [ratio(r, r["auto"]) for r in rows if r["config"]["routing"] == "node_confined" and r["config"]["top_k"] == 8]
    confined8_1l = [ratio(r, "fused_one_level") for r in rows
                    if r["config"]["routing"] == "node_confined" and r["config"]["top_k"] == 8]
    top1 = [ratio(r, r["auto"]) for r in rows if r["config"]["top_k"] == 1]
    per_variant = {name: statistics.median([ratio(r, name) for r in rows if name in r["variants"]])
                   for name in VARIANTS if any(name in r["variants"] for r in rows)}
    byte_checks = []
    for r in rows:
        base = r["variants"][BASELINE]["internode_mib"]
        two = r["variants"]["fused_two_level"]["internode_mib"]
        byte_checks.append({"config": r["config"], "world": r["world"], "implied_factor": r["dedup_factor"],
                            "measured_factor": base / two if two else None})
    return {
        "node_confined_top8_speedup_min": min(confined8) if confined8 else None,
        "node_confined_top8_speedup_median": statistics.median(confined8) if confined8 else None,
        "node_confined_top8_one_level_speedup_median": statistics.median(confined8_1l) if confined8_1l else None,
        "top1_speedup_min": min(top1) if top1 else None,
        "top1_speedup_median": statistics.median(top1) if top1 else None,
        "median_speedup_per_variant": per_variant,
        "internode_bytes": byte_checks,
        "targets": {"node_confined_top8": ">= 1.5x", "top1": ">= 0.95x", "bytes": "reduced by the dedup factor"},
    }


def plot(rows: list[dict], e2e: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    for world, marker in ((4, "o"), (8, "s")):
        for routing, color in (("uniform", "C0"), ("node_confined", "C1"), ("zipf", "C2")):
            sel = [r for r in rows if r["world"] == world and r["config"]["routing"] == routing]
            if not sel:
                continue
            x = [r["config"]["tokens"] * r["config"]["top_k"] * r["config"]["hidden"] for r in sel]
            y = [r["variants"][BASELINE]["median_ms"] / r["variants"][r["auto"]]["median_ms"] for r in sel]
            lo = [r["variants"][BASELINE]["min_ms"] / r["variants"][r["auto"]]["max_ms"] for r in sel]
            hi = [r["variants"][BASELINE]["max_ms"] / r["variants"][r["auto"]]["min_ms"] for r in sel]
            ax.errorbar(x, y, yerr=[np.subtract(y, lo), np.subtract(hi, y)], fmt=marker, color=color, alpha=0.75,
                        label=f"W={world} {routing}", capsize=2)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.5, color="r", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("pair elements per rank (T*K*H)")
    ax.set_ylabel("speedup of fused (auto) over Megatron, median (bars: min..max)")
    ax.set_title("dispatch + combine")
    ax.legend(fontsize=7)

    ax = axes[1]
    names = list(VARIANTS)
    for i, name in enumerate(names):
        ys = [r["variants"][BASELINE]["median_ms"] / r["variants"][name]["median_ms"] for r in rows
              if name in r["variants"]]
        ax.scatter(np.full(len(ys), i) + np.random.default_rng(i).uniform(-0.2, 0.2, len(ys)), ys, s=10, alpha=0.6)
        ax.plot([i - 0.3, i + 0.3], [statistics.median(ys)] * 2, color="k")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("speedup over Megatron (median per config)")
    ax.set_title("where the win comes from: copies (1L), bytes (2L), overlap (c4)")

    ax = axes[2]
    implied = [r["dedup_factor"] for r in rows]
    measured = [r["variants"][BASELINE]["internode_mib"] / max(r["variants"]["fused_two_level"]["internode_mib"], 1e-9)
                for r in rows]
    ax.scatter(implied, measured, s=12)
    lim = max(implied + measured) * 1.05
    ax.plot([1, lim], [1, lim], "k--", lw=0.8)
    ax.set_xlabel("dedup factor implied by the routing (inter-node pairs / unique crossings)")
    ax.set_ylabel("inter-node bytes: Megatron / fused two-level")
    title = "inter-node bytes"
    if e2e:
        title += " | e2e step: " + ", ".join(f"W={e['world']} x{e['speedup']:.2f}" for e in e2e)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke grid")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 3, quick 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--e2e-steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "shuffle.json")
    args = parser.parse_args(argv)
    reps = args.reps or (2 if args.quick else 3)
    configs = grid(args.quick)
    started = time.time()
    rows: list[dict] = []
    for world in args.worlds:
        print(f"== {len(configs)} configs x {len(VARIANTS)} variants on {world} gloo processes, "
              f"{args.warmup} warm-up + {reps} timed reps", flush=True)
        rows += run_local_group(_worker, world, configs, reps, args.warmup)[0]
    e2e_steps = args.e2e_steps or (4 if args.quick else 12)
    e2e = [end_to_end(4, e2e_steps, args.quick)]
    report = {
        "command": "python -m benchmarks.shuffle" + (" --quick" if args.quick else "") + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"),
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__,
                    "backend": "gloo", "nodes": NODES},
        "seconds": time.time() - started,
        "reps": reps,
        "summary": summarize(rows),
        "end_to_end": e2e,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, e2e, args.out.with_suffix(".png"))
    s = report["summary"]
    print(f"done in {report['seconds']:.0f} s -> {args.out} (+ .png)")
    print(f"node-confined top-8 speedup: min x{s['node_confined_top8_speedup_min']}, "
          f"median x{s['node_confined_top8_speedup_median']}; top-1 min x{s['top1_speedup_min']}; "
          f"e2e: " + ", ".join(f"W={e['world']} x{e['speedup']:.2f}" for e in e2e))


if __name__ == "__main__":
    main()
