"""The unrolled dependency graph of a workflow, and the version rules that make a schedule legal.

``build_graph`` unrolls the body for a range of iterations into op instances in *sequential
order* (depth-first through the loop scopes) and derives the edges every schedule must keep:

* read-after-write: the producer of each version a read names;
* write-after-read / write-after-write, for in-place state kept in ``k`` buffers: the writer of
  version ``n`` waits for the readers and the writer of version ``n-k``.

Everything else a plan adds (iteration barriers, program order on a worker, stage grouping) is a
*schedule* edge and may be removed. ``verify_order`` replays any execution order against the
buffer slots and reports the first read that would see a different version than the sequential
schedule — the ground truth behind every legality decision.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from components.scheduler.workflow import ITERATION, ForEach, OpSpec, StateRef, Workflow, WorkflowError

RAW, WAR, WAW = "raw", "war", "waw"


@dataclass(frozen=True, order=True)
class VersionKey:
    """One version of one (partition of a) state: ``obs[1]@(3, 17)``."""

    state: str
    part: int | None
    version: tuple[int, ...]

    def __str__(self) -> str:
        p = "" if self.part is None else f"[{self.part}]"
        return f"{self.state}{p}@{','.join(map(str, self.version))}"


@dataclass(frozen=True)
class OpInstance:
    """One execution of an op at concrete loop indices."""

    uid: int
    op: OpSpec
    idx: tuple[tuple[str, int], ...]
    reads: tuple[VersionKey, ...]
    writes: tuple[VersionKey, ...]
    read_groups: tuple[tuple[str, tuple[VersionKey, ...], bool], ...] = ()

    @property
    def indices(self) -> dict[str, int]:
        return dict(self.idx)

    @property
    def iteration(self) -> int:
        return self.idx[0][1]

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def component(self) -> str:
        return self.op.component

    def label(self) -> str:
        return f"{self.op.name}[{','.join(f'{k[0]}={v}' for k, v in self.idx)}]"


@dataclass
class Graph:
    """Op instances in sequential order plus their semantic predecessor edges."""

    workflow: Workflow
    iterations: range
    instances: list[OpInstance]
    preds: list[dict[int, str]]
    producer: dict[VersionKey, int]
    readers: dict[VersionKey, list[int]]
    inputs: set[VersionKey]
    buffers: dict[str, int | None]
    succs: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.succs:
            self.succs = [[] for _ in self.instances]
            for uid, ps in enumerate(self.preds):
                for p in ps:
                    self.succs[p].append(uid)

    def __len__(self) -> int:
        return len(self.instances)

    def by_name(self, name: str) -> list[OpInstance]:
        return [i for i in self.instances if i.op.name == name]

    def edge_kind(self, src: int, dst: int) -> str | None:
        return self.preds[dst].get(src)


def _resolve_many(ref: StateRef, idx: dict[str, int], wf: Workflow, where: str) -> list[VersionKey]:
    """All keys a (possibly multi) reference names, in version / part order."""
    if ref.all_parts:
        assert ref.part is not None
        return [_resolve(ref, {**idx, ref.part: k}, wf, where) for k in range(wf.loops[ref.part])]
    if ref.absolute == "*":
        return [_resolve(StateRef(ref.name, ref.loop, ref.part, 0, k), idx, wf, where) for k in range(wf.loops[ref.loop])]
    return [_resolve(ref, idx, wf, where)]


def _resolve(ref: StateRef, idx: dict[str, int], wf: Workflow, where: str) -> VersionKey:
    order = wf.version_order
    upto = order.index(ref.loop)
    version: list[int] = []
    for loop in order[: upto + 1]:
        if loop == ref.part:
            continue
        if loop == ref.loop:
            if ref.absolute == "end":
                version.append(wf.loops[loop])
            elif ref.absolute is not None:
                version.append(ref.absolute)
            else:
                version.append(idx[loop] + ref.offset)
        elif loop in idx:
            version.append(idx[loop])
        elif loop != ITERATION and loop not in idx:
            # a loop between iteration and the version loop the op is not inside: only fine if it
            # is some other partition axis that this state does not use
            continue
    part = idx[ref.part] if ref.part is not None else None
    return VersionKey(ref.name, part, tuple(version))


def unroll(wf: Workflow, iterations: Iterable[int]) -> list[tuple[OpSpec, tuple[tuple[str, int], ...]]]:
    """The sequential order: (op, indices) depth first through the loop scopes."""
    out: list[tuple[OpSpec, tuple[tuple[str, int], ...]]] = []

    def walk(body: Sequence[OpSpec | ForEach], idx: tuple[tuple[str, int], ...]) -> None:
        for item in body:
            if isinstance(item, ForEach):
                for k in range(wf.loops[item.loop]):
                    walk(item.body, (*idx, (item.loop, k)))
            else:
                out.append((item, idx))

    for it in iterations:
        walk(wf.body, ((ITERATION, it),))
    return out


def build_graph(wf: Workflow, iterations: range, buffers: dict[str, int | None] | None = None) -> Graph:
    """Unroll ``wf`` over ``iterations`` and derive the semantic edges.

    ``buffers`` overrides state buffer depths (a double-buffering transformation); raising one is
    only allowed for states declared ``double_bufferable``.
    """
    depth: dict[str, int | None] = {s.name: s.buffers for s in wf.states}
    for name, k in (buffers or {}).items():
        spec = wf.state(name)
        if k == spec.buffers:
            continue
        if spec.buffers is None:
            raise WorkflowError(f"state {name!r} is immutable (a new value per version): it needs no buffers")
        if k is None or k < spec.buffers:
            raise WorkflowError(f"state {name!r}: cannot lower buffers to {k} (declared {spec.buffers})")
        if not spec.double_bufferable:
            raise WorkflowError(
                f"state {name!r} is not double_bufferable; declare StateSpec(..., double_bufferable=True) "
                "if its component can keep two copies"
            )
        depth[name] = k

    instances: list[OpInstance] = []
    producer: dict[VersionKey, int] = {}
    readers: dict[VersionKey, list[int]] = defaultdict(list)
    for uid, (op, idx) in enumerate(unroll(wf, iterations)):
        d = dict(idx)
        where = f"op {op.name!r} at {d}"
        groups = []
        for t in op.reads:
            ref = StateRef.parse(t, where)
            groups.append((ref.name, tuple(_resolve_many(ref, d, wf, where)), ref.is_multi))
        reads = tuple(k for _, keys, _ in groups for k in keys)
        writes = tuple(_resolve(StateRef.parse(t, where), d, wf, where) for t in op.writes)
        for key in writes:
            if key in producer:
                other = instances[producer[key]]
                raise WorkflowError(
                    f"{key} is written twice: by {other.label()} and {op.name}{d}; every version needs "
                    "exactly one writer (bump the version with @loop+1)"
                )
            producer[key] = uid
        for key in reads:
            readers[key].append(uid)
        instances.append(OpInstance(uid, op, idx, reads, writes, tuple(groups)))

    preds: list[dict[int, str]] = [dict() for _ in instances]
    inputs: set[VersionKey] = set()
    for inst in instances:
        for key in inst.reads:
            src = producer.get(key)
            if src is None:
                inputs.add(key)
            elif src >= inst.uid and src != inst.uid:
                raise WorkflowError(
                    f"{inst.label()} reads {key} which is only written later by {instances[src].label()}; "
                    "in sequential order a read must follow its write"
                )
            elif src != inst.uid:
                preds[inst.uid][src] = RAW

    # in-place states: the writer of a version waits for the previous occupant of its buffer slot
    chains: dict[tuple[str, int | None, int], list[VersionKey]] = defaultdict(list)
    for key in sorted(inputs, key=lambda v: v.version):
        if depth[key.state] is not None:
            chains[(key.state, key.part, slot_of(key, depth[key.state]))].append(key)
    for inst in instances:
        for key in inst.writes:
            k = depth[key.state]
            if k is not None:
                chains[(key.state, key.part, slot_of(key, k))].append(key)
    for (state, _, _), seq in chains.items():
        for old, key in zip(seq, seq[1:]):
            w = producer[key]
            if old in producer and producer[old] != w:
                preds[w].setdefault(producer[old], WAW)
            for r in readers.get(old, []):
                if r == w:
                    continue
                if r > w:
                    raise WorkflowError(
                        f"{instances[r].label()} reads {old} after {instances[w].label()} overwrote it "
                        f"in sequential order; state {state!r} needs more buffers"
                    )
                preds[w].setdefault(r, WAR)
    return Graph(wf, iterations, instances, preds, producer, dict(readers), inputs, depth)


def slot_of(key: VersionKey, buffers: int) -> int:
    """Which physical buffer holds ``key``: buffers alternate by iteration (the first version index)."""
    return key.version[0] % buffers if buffers > 1 else 0


class LegalityError(ValueError):
    """A proposed schedule would let some read see a different version than sequential order."""


def verify_order(graph: Graph, order: Sequence[int]) -> None:
    """Replay an execution order (a linearization, or completion order of a parallel run).

    Checks, per read, that the version exists and, for in-place states, still sits in its slot
    (not overwritten by a newer version). Raises ``LegalityError`` naming the first violation.
    """
    if sorted(order) != list(range(len(graph))):
        raise LegalityError("order must contain every op instance exactly once")
    written: set[VersionKey] = set(graph.inputs)
    slot_holder: dict[tuple[str, int | None, int], VersionKey] = {}
    for key in sorted(graph.inputs, key=lambda v: v.version):
        k = graph.buffers[key.state]
        if k is not None:
            slot_holder[(key.state, key.part, slot_of(key, k))] = key
    for uid in order:
        inst = graph.instances[uid]
        for key in inst.reads:
            if key not in written:
                raise LegalityError(f"{inst.label()} would read {key} before it is written")
            k = graph.buffers[key.state]
            if k is not None and slot_holder.get((key.state, key.part, slot_of(key, k))) != key:
                now = slot_holder.get((key.state, key.part, slot_of(key, k)))
                raise LegalityError(
                    f"{inst.label()} would read {key} but its buffer already holds {now} "
                    f"(state {key.state!r} has {k} buffer(s))"
                )
        for key in inst.writes:
            written.add(key)
            k = graph.buffers[key.state]
            if k is not None:
                slot_holder[(key.state, key.part, slot_of(key, k))] = key


def topo_order(graph: Graph, extra: dict[int, set[int]] | None = None, what: str = "schedule") -> list[int]:
    """A topological order over semantic + ``extra`` edges (dst -> srcs), smallest uid first.

    Raises ``LegalityError`` when the extra edges contradict the version dependencies (a cycle).
    """
    import heapq

    n = len(graph)
    succ: list[list[int]] = [list(s) for s in graph.succs]
    for dst, srcs in (extra or {}).items():
        for s in srcs:
            succ[s].append(dst)
    indeg = [0] * n
    for s in range(n):
        for d in succ[s]:
            indeg[d] += 1
    ready = [u for u in range(n) if indeg[u] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        u = heapq.heappop(ready)
        order.append(u)
        for d in succ[u]:
            indeg[d] -= 1
            if indeg[d] == 0:
                heapq.heappush(ready, d)
    if len(order) != n:
        stuck = [graph.instances[u].label() for u in range(n) if indeg[u] > 0][:4]
        raise LegalityError(f"{what} contradicts the version dependencies (cycle through {stuck} ...)")
    return order


def critical_path(
    graph: Graph, durations: Sequence[float], extra: dict[int, set[int]] | None = None
) -> tuple[float, list[int]]:
    """Longest path (seconds) and its op uids, over semantic + ``extra`` edges."""
    n = len(graph)
    finish = [0.0] * n
    best_pred = [-1] * n
    preds: list[set[int]] = [set(p) for p in graph.preds]
    for dst, srcs in (extra or {}).items():
        preds[dst] |= srcs
    for u in topo_order(graph, extra, "critical path"):
        start = 0.0
        for p in preds[u]:
            if finish[p] > start:
                start, best_pred[u] = finish[p], p
        finish[u] = start + durations[u]
    end = max(range(n), key=lambda u: finish[u])
    path = [end]
    while best_pred[path[-1]] >= 0:
        path.append(best_pred[path[-1]])
    return finish[end], path[::-1]
