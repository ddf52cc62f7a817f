"""Process workers: a worker of a plan that runs its components in a child process.

The parent holds a ``ProcessHost`` per process worker and sends it ``ProcessCall``s; the child
(``_process_main``) builds the hosted components once, then runs ops on request and streams each
result back. Versions the child reads more than once cross the pipe once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from components.scheduler.plan import WorkerSpec
from components.scheduler.quotas import apply_blas_limit, set_worker_threads
from components.scheduler.run_result import ExecutionError
from components.scheduler.workflow import BuildContext, Workflow

PROCESS_POLL_S = 0.5  # how often a parent checks that a silent process worker is still alive
WORKER_PRELOAD = ("torch", "components.scheduler.process_worker")  # imported once, in the fork server


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


def op_args(read_groups, values: Mapping[Any, Any]) -> dict[str, Any]:
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
                args = op_args(call.groups, values)
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
class ProcessCall:
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


class ProcessHost:
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

    def send(self, calls: list[ProcessCall]) -> tuple[int, float]:
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


def wait_all_ready(hosts: dict[str, ProcessHost]) -> None:
    """Wait until every launched process worker has built its components; if one fails, stop them all."""
    try:
        for h in hosts.values():
            h.wait_ready()
    except BaseException:
        for h in hosts.values():
            h.stop()
        raise
