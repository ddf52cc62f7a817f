"""Accelerator check of the shuffle under torchrun: exactness vs the dense reference, then a small timing.

    torchrun --standalone --nproc-per-node=N -m components.shuffle.device_check [--backend nccl]

Every rank builds the same global batch (dyadic values: every fp32 sum is exact in any order),
takes its shard, runs dispatch -> per-expert matmul -> combine -> backward with the fused path
(``ShuffleConfig()``: plan auto), the fused permute plan (auto's choice when the MoE layer passes
its counts) and the Megatron baseline on ``cuda:LOCAL_RANK`` (CPU with
gloo when no GPU), and compares outputs and input gradients with ``dense_reference`` bit for bit.
Then it times ABAB pairs of (megatron, fused) dispatch + combine on a small shape (synchronized,
slowest rank) and prints the median pair ratio. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from components.config import ShuffleConfig
from components.shuffle.dispatchers import make_dispatcher
from components.shuffle.routing import Placement, Routing, dense_reference, synthetic_routing

CHECK_TOKENS, CHECK_HIDDEN, CHECK_EXPERTS_PER_RANK = 64, 32, 4
TIME_TOKENS, TIME_HIDDEN, TIME_PAIRS = 4096, 1024, 10
CASES = (("uniform", 1), ("uniform", 2), ("zipf", 4), ("node_confined", 4))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_exact(rank: int, world: int, device: torch.device) -> list[str]:
    """Mismatches (empty = every case bit-exact) for fused and megatron on this rank's shard."""
    E = CHECK_EXPERTS_PER_RANK * world
    placement = Placement(E, world, world)
    failures = []
    for routing_kind, k in CASES:
        g = torch.Generator().manual_seed(k)
        T = CHECK_TOKENS * world
        ids = synthetic_routing(routing_kind, T, k, placement, g)
        x = torch.randint(-4, 5, (T, CHECK_HIDDEN), generator=g).float()
        probs = torch.randint(1, 9, (T, k), generator=g).float() / 8
        w = torch.randint(-2, 3, (E, CHECK_HIDDEN, CHECK_HIDDEN), generator=g).float() / 2
        grad = torch.randint(-2, 3, (T, CHECK_HIDDEN), generator=g).float()
        xr = x.clone().requires_grad_(True)
        ref = dense_reference(xr, Routing(ids, probs), lambda e, rows: rows @ w[e], E)
        (ref * grad).sum().backward()
        shard = slice(rank * CHECK_TOKENS, (rank + 1) * CHECK_TOKENS)
        local = slice(rank * placement.local_experts, (rank + 1) * placement.local_experts)
        for name, cfg in (("fused", ShuffleConfig()), ("fused permute", ShuffleConfig(plan="permute")),
                          ("megatron", ShuffleConfig(dispatcher="megatron"))):
            disp = make_dispatcher(placement, dist.group.WORLD, cfg)
            xs = x[shard].to(device).requires_grad_(True)
            d = disp.dispatch(xs, Routing(ids[shard].to(device), probs[shard].to(device)))
            wl = w[local].to(device)
            parts = [rows @ wl[l] for l, rows in enumerate(d.x.split(list(d.tokens_per_expert)))]
            out = disp.combine(torch.cat(parts) if parts else d.x, d.handle)
            (out * grad[shard].to(device)).sum().backward()
            for what, got, want in (("out", out.detach(), ref.detach()[shard]), ("grad x", xs.grad, xr.grad[shard])):
                if not torch.equal(got.cpu(), want):
                    failures.append(f"rank {rank}: {name} {routing_kind} top-{k}: {what} differs")
    return failures


def timing_placement(world: int, k: int) -> Placement:
    """At least CHECK_EXPERTS_PER_RANK experts per rank, and enough in all for top-k (one GPU: 8 for top-8)."""
    per_rank = max(CHECK_EXPERTS_PER_RANK, -(-k // world))
    return Placement(per_rank * world, world, world)


def timing_setup(rank: int, world: int, device: torch.device, k: int, tokens: int, plans: list[str]):
    """(dispatchers "megatron" and "fused(PLAN)" per plan, tokens x, routing) for the timing and the
    profile: uniform top-k routing."""
    placement = timing_placement(world, k)
    g = torch.Generator().manual_seed(100 + rank)
    ids = synthetic_routing("uniform", tokens, k, placement, g).to(device)
    routing = Routing(ids, torch.softmax(torch.randn(tokens, k, generator=g), 1).to(device))
    x = torch.randn(tokens, TIME_HIDDEN, generator=g).to(device)
    configs = {"megatron": ShuffleConfig(dispatcher="megatron"), **{f"fused({p})": ShuffleConfig(plan=p) for p in plans}}
    disp = {name: make_dispatcher(placement, dist.group.WORLD, cfg) for name, cfg in configs.items()}
    return disp, x, routing


def _round_trip(dispatcher, x: torch.Tensor, routing: Routing) -> None:
    with torch.no_grad():
        d = dispatcher.dispatch(x, routing)
        dispatcher.combine(d.x, d.handle)


def time_pairs(rank: int, world: int, device: torch.device, k: int, tokens: int, pairs: int, plan: str) -> float:
    """Median over ABAB pairs of megatron time / fused time (dispatch + identity experts + combine)."""
    disp, x, routing = timing_setup(rank, world, device, k, tokens, [plan])
    fused = f"fused({plan})"

    def timed(name: str) -> float:
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        _round_trip(disp[name], x, routing)
        _sync(device)
        el = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        return float(el)

    for name in disp:  # warm-up
        timed(name)
    ratios = []
    for i in range(pairs):
        order = ("megatron", fused) if i % 2 == 0 else (fused, "megatron")
        t = {n: timed(n) for n in order}
        ratios.append(t["megatron"] / t[fused])
    return statistics.median(ratios)


def profile_table(rank: int, world: int, device: torch.device, k: int, tokens: int, plans: list[str],
                  rows: int = 14) -> str:
    """torch.profiler's top ops by self time (device time on CUDA) for one warm round trip of Megatron
    and of the fused dispatcher with each of ``plans``."""
    from torch.profiler import ProfilerActivity, profile

    disp, x, routing = timing_setup(rank, world, device, k, tokens, plans)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    tables = []
    for name, dispatcher in disp.items():
        _round_trip(dispatcher, x, routing)  # warm: staging buffers, caches
        _sync(device)
        with profile(activities=activities) as prof:
            _round_trip(dispatcher, x, routing)
            _sync(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        tables.append(f"--- {name}, top-{k}, {tokens} tokens, sorted by {key}\n"
                      + prof.key_averages().table(sort_by=key, row_limit=rows))
    return "\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument("--time-tokens", type=int, default=TIME_TOKENS, help="tokens per rank in the timing")
    parser.add_argument("--time-pairs", type=int, default=TIME_PAIRS, help="ABAB pairs timed per top-k")
    parser.add_argument("--plans", nargs="+", default=["auto"], help="fused plans timed against megatron "
                        "(shuffle.plan values; a plan that does not fit the routing fails)")
    parser.add_argument("--profile", action="store_true", help="then print torch.profiler's top ops at top-8 (rank 0)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if args.backend == "auto" else args.backend
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        failures = check_exact(rank, world, device)
        flags = torch.tensor([len(failures)], device=device)
        dist.all_reduce(flags)
        for f in failures:
            print(f, flush=True)
        if rank == 0:  # before the timing, so a failure there cannot hide the exactness verdict
            print(f"device_check: backend={backend} world={world} device={device.type}: exactness "
                  f"{'OK' if int(flags) == 0 else f'FAILED ({int(flags)} mismatches)'}", flush=True)
        ratios = {(k, plan): time_pairs(rank, world, device, k, args.time_tokens, args.time_pairs, plan)
                  for k in (1, 8) for plan in args.plans}
        if rank == 0:
            print(f"device_check: megatron/fused median pair ratio at {args.time_tokens} tokens x {TIME_HIDDEN} "
                  "hidden per rank: " + ", ".join(f"top-{k} {plan} x{r:.2f}" for (k, plan), r in ratios.items()),
                  flush=True)
        if args.profile:
            table = profile_table(rank, world, device, 8, args.time_tokens, args.plans)
            if rank == 0:
                print(table, flush=True)
        return 0 if int(flags) == 0 else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
