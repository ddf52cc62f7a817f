"""Run a function on N local gloo processes (tests, benchmark): loopback only, 1 thread per rank.

``run_local_group(fn, world_size, *args)`` spawns ranks 0..N-1, each calls
``fn(rank, world_size, *args)`` inside an initialized gloo process group, and returns the list of
per-rank return values (picklable). A rank that raises fails the whole call with its traceback.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_lib
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOOPBACK = "127.0.0.1"
GROUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's data sockets on loopback
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),
        )
        result = fn(rank, world, *args)
        dist.barrier()
        queue.put((rank, True, pickle.dumps(result)))  # plain bytes: no shared-memory handles
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_group(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    while len(results) < world_size and not errors:
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queue_lib.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead:
                errors.append(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
            continue
        if ok:
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
    if errors:
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("local process group failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
