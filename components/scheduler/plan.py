"""A plan: how one logical workflow is executed (workers, placement, stages, quotas, transformations).

The same ``Workflow`` runs under any ``Plan``; results never depend on the plan (tests check it
bit for bit). ``sequential_plan`` is the reference: one worker, body order, iteration barriers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from components.scheduler.workflow import Workflow


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: a thread (or a spawned process) hosting some components, pinned to cores."""

    name: str
    components: tuple[str, ...]
    kind: Literal["thread", "process"] = "thread"
    cores: tuple[int, ...] | None = None  # CPU affinity; None = leave as is
    groups: tuple[int, ...] | None = None  # env groups this worker serves for the replicated components it hosts
    turn: tuple[int, int] | None = None  # (r, k): it runs its stateless replicated components' ops of iterations i = r mod k


@dataclass(frozen=True)
class Plan:
    """Everything a plan decides. Fields not set keep the sequential behaviour.

    * ``groups`` — env-group count (pipeline stage count ``m``) for the workflow's group loop.
    * ``placement`` — devices per *exclusive* component (device lock, memory budget).
    * ``threads`` — per-component compute quota: intra-op threads on CPU (quota_invariant ops
      only may differ from the reference); ``gpu_percent`` — MPS SM share for process workers.
    * ``pinned_threads`` — thread counts that ops declared not ``quota_invariant`` always run
      with (part of the numerics, identical in every plan and in the reference).
    * ``blas_threads`` — process-wide BLAS thread limit (``None``: library default).
    * ``hoist`` — ops exempt from the iteration barrier: they run in the previous iteration's tail.
    * ``buffers`` — buffer-depth overrides (double-buffering).
    * ``barrier`` — whether iteration ``i+1`` waits for all of iteration ``i``.
    * ``lag`` — ops whose instance of iteration ``i`` the barrier of iteration ``i + lag`` waits for
      instead of iteration ``i``'s (side work that may trail the chain, e.g. validation on replicas
      taking turns: the chain runs ahead by at most ``lag`` iterations).
    """

    name: str
    workers: tuple[WorkerSpec, ...]
    groups: int | None = None
    placement: dict[str, tuple[str, ...]] = field(default_factory=dict)
    threads: dict[str, int] = field(default_factory=dict)
    gpu_percent: dict[str, int] = field(default_factory=dict)
    blas_threads: int | None = None
    default_threads: int | None = None
    pinned_threads: dict[str, int] = field(default_factory=dict)
    hoist: frozenset[str] = frozenset()
    buffers: dict[str, int] = field(default_factory=dict)
    barrier: bool = True
    lag: dict[str, int] = field(default_factory=dict)
    cuda_streams: bool = False  # each worker thread issues its ops on its own CUDA stream
    predicted_s: float | None = None
    notes: tuple[str, ...] = ()

    def hosts(self, component: str) -> list[WorkerSpec]:
        """Every worker hosting ``component`` (several: the component is replicated over env groups)."""
        return [w for w in self.workers if component in w.components]

    def worker_of(self, component: str, group: int | None = None, iteration: int | None = None) -> WorkerSpec:
        """The worker that runs ``component``'s op for env group ``group`` at ``iteration``. A
        component replicated by turns runs iteration ``i``'s ops on the replica whose turn is
        ``i mod k``; one replicated over env groups runs each group's ops on the replica serving that
        group, and its group-independent ops (which a replicable component keeps stateless) on its
        first replica."""
        hosts = self.hosts(component)
        if not hosts:
            raise KeyError(f"plan {self.name!r} places no worker for component {component!r}")
        if len(hosts) > 1 and iteration is not None and hosts[0].turn is not None:
            for w in hosts:
                if w.turn is not None and iteration % w.turn[1] == w.turn[0]:
                    return w
            raise KeyError(f"plan {self.name!r}: no replica of {component!r} takes iteration {iteration}'s turn")
        if len(hosts) == 1 or group is None:
            return hosts[0]
        for w in hosts:
            if w.groups is not None and group in w.groups:
                return w
        raise KeyError(f"plan {self.name!r}: no replica of {component!r} serves env group {group}")

    def replica_index(self, component: str, worker: str) -> int:
        """Position of ``worker`` among ``component``'s replicas (0 when it is not replicated)."""
        return [w.name for w in self.hosts(component)].index(worker)

    def with_(self, **changes: object) -> Plan:
        return replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        lines = [f"plan {self.name}:"]
        for w in self.workers:
            cores = "any" if w.cores is None else ",".join(map(str, w.cores))
            groups = "" if w.groups is None else f" for env groups {','.join(map(str, w.groups))}"
            groups += "" if w.turn is None else f" for iterations = {w.turn[0]} mod {w.turn[1]}"
            lines.append(f"  worker {w.name:<10} {w.kind:<7} cores={cores:<5} hosts {', '.join(w.components)}{groups}")
        if self.groups:
            lines.append(f"  env groups (pipeline stages m) = {self.groups}")
        if self.threads:
            lines.append("  thread quotas: " + ", ".join(f"{k}={v}" for k, v in sorted(self.threads.items())))
        if self.gpu_percent:
            lines.append("  MPS SM %: " + ", ".join(f"{k}={v}" for k, v in sorted(self.gpu_percent.items())))
        if self.blas_threads is not None:
            lines.append(f"  BLAS threads = {self.blas_threads}")
        if self.placement:
            lines.append("  devices: " + ", ".join(f"{k}->{'+'.join(v)}" for k, v in sorted(self.placement.items())))
        if self.lag:
            lines.append("  trailing the barrier: " + ", ".join(f"{k} by {v}" for k, v in sorted(self.lag.items())))
        if self.hoist:
            lines.append("  hoisted across the iteration barrier: " + ", ".join(sorted(self.hoist)))
        if self.cuda_streams:
            lines.append("  CUDA: one stream per worker")
        if self.buffers:
            lines.append("  buffers: " + ", ".join(f"{k}={v}" for k, v in sorted(self.buffers.items())))
        if self.predicted_s is not None:
            lines.append(f"  predicted iteration time: {self.predicted_s * 1e3:.1f} ms")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def sequential_plan(workflow: Workflow, threads: int | None = None, blas_threads: int | None = None,
                    groups: int | None = None, name: str = "sequential") -> Plan:
    """The reference schedule: every component on one worker thread, body order, barriers."""
    comps = tuple(c.name for c in workflow.components)
    return Plan(
        name=name,
        workers=(WorkerSpec("main", comps),),
        groups=groups,
        default_threads=threads,
        blas_threads=blas_threads,
    )


def plan_to_dict(plan: Plan) -> dict:
    """A JSON-able form of ``plan`` (``plan_from_dict`` reads it back), for plan caches."""
    from dataclasses import asdict

    out = asdict(plan)
    out["hoist"] = sorted(plan.hoist)
    return out


def plan_from_dict(raw: dict) -> Plan:
    def tup(x: object) -> tuple | None:
        return None if x is None else tuple(x)  # type: ignore[arg-type]

    workers = tuple(WorkerSpec(w["name"], tuple(w["components"]), w["kind"], tup(w["cores"]), tup(w["groups"]),
                               tup(w.get("turn")))  # type: ignore[arg-type]
                    for w in raw["workers"])
    return Plan(
        name=raw["name"], workers=workers, groups=raw["groups"],
        placement={k: tuple(v) for k, v in raw["placement"].items()}, threads=dict(raw["threads"]),
        gpu_percent=dict(raw["gpu_percent"]), blas_threads=raw["blas_threads"], default_threads=raw["default_threads"],
        pinned_threads=dict(raw["pinned_threads"]), hoist=frozenset(raw["hoist"]), buffers=dict(raw["buffers"]),
        barrier=raw["barrier"], lag=dict(raw.get("lag", {})), cuda_streams=raw["cuda_streams"], predicted_s=raw["predicted_s"],
        notes=tuple(raw["notes"]),
    )
