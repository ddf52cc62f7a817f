"""The workflow interface: components, nested loop scopes, and ops over versioned state.

A workflow is declared once and executed under any plan. Its parts:

* ``Component`` — a unit that owns state (an env group, a policy copy, a learner), with the
  device and process needs the planner and the executor honour.
* ``Loop`` / ``ForEach`` — nested loop scopes. ``iteration`` is the implicit outermost loop;
  inner loops (``step``, ``group``) have fixed counts. The body is executed depth first, which
  *is* the sequential schedule.
* ``OpSpec`` — one op: the component it runs on, and the versioned state it reads and writes,
  written as ``name[partition]@loop±k`` (``obs[group]@step+1``), ``name@loop=k`` for an absolute
  version (``obs[group]@step=0``) or ``name@loop=end`` for the loop's count.

From a workflow, ``components.scheduler.graph.build_graph`` unrolls the concrete op instances
and the dependency edges the versions imply.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ITERATION = "iteration"

#: ``fn(component_state, indices, inputs) -> outputs``; inputs/outputs keyed by state name.
OpFn = Callable[[Any, dict[str, int], dict[str, Any]], dict[str, Any]]
#: Hook called with the component state when its device lock changes hands.
SwitchHook = Callable[[Any], None]

_REF = re.compile(r"^(?P<name>[A-Za-z_][\w]*)(\[(?P<part>[A-Za-z_]\w*)(?P<pall>=\*)?\])?@(?P<loop>[A-Za-z_]\w*)"
                  r"(?:(?P<sign>[+-])(?P<off>\d+)|=(?P<abs>\d+|end|\*))?$")


class WorkflowError(ValueError):
    """A workflow declaration is inconsistent (message names the op/state and the fix)."""


@dataclass(frozen=True)
class BuildContext:
    """What a component factory gets: the workload's payload (picklable), the loop counts, and for a
    replica the env groups it serves (``None``: every group)."""

    payload: Any
    loops: dict[str, int]
    groups: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Component:
    """A stateful unit of the workflow and its resource needs.

    ``factory(BuildContext)`` builds the component's state on the worker that hosts it (so a process
    worker builds it in its own process). ``exclusive`` components (models) take a per-device lock
    for every op and pay ``onload``/``offload`` when the device changes hands; host-side code such
    as a CPU simulator is not exclusive. ``memory_mb`` counts against the device's budget while
    the component is onloaded. ``replicable``: the component keeps only per-env-group state (each
    group-indexed op touches its own group's part) and its group-independent ops are pure, so a plan
    may host one replica per set of env groups on several workers (data-parallel rollout).
    ``stateless``: every op's outputs depend only on its inputs (the component rebuilds what it needs
    from what it reads, e.g. a validator that loads the weights it is given), so a plan may run its
    ops of different iterations on different replicas (``WorkerSpec.turn``).
    """

    name: str
    factory: Callable[[BuildContext], Any]
    device: Literal["cpu", "accelerator"] = "cpu"
    exclusive: bool = False
    memory_mb: float = 0.0
    onload: SwitchHook | None = None
    offload: SwitchHook | None = None
    process_ok: bool = True
    replicable: bool = False
    stateless: bool = False


@dataclass(frozen=True)
class StateSpec:
    """A piece of versioned state.

    ``buffers=None``: values are immutable (a new object per version) so writers never wait for
    readers of older versions. ``buffers=k``: the state lives in ``k`` physical slots mutated in
    place (an env, a loaded model), so the writer of version ``n`` waits for every reader of
    version ``n-k`` (write-after-read) and the writer of ``n-k`` (write-after-write).
    ``double_bufferable`` says a transformation may raise ``buffers`` from 1 to 2.
    """

    name: str
    buffers: int | None = None
    double_bufferable: bool = False
    memory_mb: float = 0.0


@dataclass(frozen=True)
class StateRef:
    """A parsed ``name[part]@loop±k`` / ``name@loop=k`` reference."""

    name: str
    loop: str
    part: str | None = None
    offset: int = 0
    absolute: int | Literal["end", "*"] | None = None
    all_parts: bool = False

    @property
    def is_multi(self) -> bool:
        """Reads a list: every version of its loop (``@step=*``) or every part (``[group=*]``)."""
        return self.all_parts or self.absolute == "*"

    @classmethod
    def parse(cls, text: str, where: str) -> StateRef:
        m = _REF.match(text.replace(" ", ""))
        if not m:
            raise WorkflowError(
                f"{where}: state reference {text!r} is malformed; write name[part]@loop, "
                "name@loop+1 or name@loop=0 (e.g. 'obs[group]@step+1')"
            )
        off = int(m["off"]) * (-1 if m["sign"] == "-" else 1) if m["off"] else 0
        absolute: int | Literal["end", "*"] | None = None
        if m["abs"] is not None:
            absolute = m["abs"] if m["abs"] in ("end", "*") else int(m["abs"])
        ref = cls(m["name"], m["loop"], m["part"], off, absolute, bool(m["pall"]))
        if ref.all_parts and ref.absolute == "*":
            raise WorkflowError(f"{where}: {text!r} reads all parts and all versions at once; split it in two ops")
        return ref


@dataclass(frozen=True)
class OpSpec:
    """One op of the workflow body.

    ``side`` marks work off the main component chain (evaluation, prefetch) that a plan may run
    on its own worker. ``quota_invariant`` marks ops whose outputs do not depend on the thread
    count they run with (verified by the quota manager before it changes one).
    """

    name: str
    component: str
    fn: OpFn
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    side: bool = False
    quota_invariant: bool = True


@dataclass(frozen=True)
class ForEach:
    """A nested loop scope over ``loop`` containing ops and further scopes, in order."""

    loop: str
    body: tuple[OpSpec | ForEach, ...]


@dataclass(frozen=True)
class Workflow:
    """A complete declaration: components, states, loop counts and the iteration body."""

    name: str
    components: tuple[Component, ...]
    states: tuple[StateSpec, ...]
    loops: dict[str, int]
    body: tuple[OpSpec | ForEach, ...]
    version_order: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise WorkflowError(f"workflow {self.name}: duplicate component names {names}")
        snames = [s.name for s in self.states]
        if len(set(snames)) != len(snames):
            raise WorkflowError(f"workflow {self.name}: duplicate state names {snames}")
        for loop, count in self.loops.items():
            if loop == ITERATION:
                raise WorkflowError(f"workflow {self.name}: 'iteration' is implicit; drop it from loops")
            if count < 1:
                raise WorkflowError(f"workflow {self.name}: loop {loop!r} has count {count}; it must be >= 1")
        if not self.version_order:
            object.__setattr__(self, "version_order", (ITERATION, *self.loops))
        for op, scope in self.ops_with_scope():
            read_names = [StateRef.parse(t, f"op {op.name!r}").name for t in op.reads]
            if len(set(read_names)) != len(read_names):
                raise WorkflowError(f"op {op.name!r} reads the same state twice: {op.reads}; split the op")
            if op.component not in names:
                raise WorkflowError(
                    f"op {op.name!r} runs on component {op.component!r} which is not declared; "
                    f"declared components: {names}"
                )
            for text in (*op.reads, *op.writes):
                ref = StateRef.parse(text, f"op {op.name!r}")
                if ref.name not in snames:
                    raise WorkflowError(f"op {op.name!r} uses undeclared state {ref.name!r}; add a StateSpec")
                if ref.loop not in self.version_order:
                    raise WorkflowError(f"op {op.name!r}: {text!r} versions by unknown loop {ref.loop!r}")
                if ref.is_multi and text in op.writes:
                    raise WorkflowError(f"op {op.name!r}: {text!r} — only reads may name many versions/parts")
                if ref.part is not None and not ref.all_parts and ref.part not in scope:
                    raise WorkflowError(
                        f"op {op.name!r}: {text!r} is partitioned by {ref.part!r} but the op is not inside "
                        f"ForEach({ref.part!r}); its scope is {scope}"
                    )
                if ref.all_parts and ref.part not in self.loops:
                    raise WorkflowError(f"op {op.name!r}: {text!r} reads all parts of unknown loop {ref.part!r}")
                if ref.absolute is None and ref.loop not in scope:
                    raise WorkflowError(
                        f"op {op.name!r}: {text!r} is relative to loop {ref.loop!r} outside its scope {scope}; "
                        f"use an absolute version such as {ref.name}@{ref.loop}=0"
                    )

    # ------------------------------------------------------------------ queries
    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"workflow {self.name} has no component {name!r}")

    def state(self, name: str) -> StateSpec:
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(f"workflow {self.name} has no state {name!r}")

    def ops_with_scope(self) -> list[tuple[OpSpec, tuple[str, ...]]]:
        """Every op with its enclosing loop scope (``iteration`` first), in body order."""
        out: list[tuple[OpSpec, tuple[str, ...]]] = []

        def walk(body: Sequence[OpSpec | ForEach], scope: tuple[str, ...]) -> None:
            for item in body:
                if isinstance(item, ForEach):
                    if item.loop not in self.loops:
                        raise WorkflowError(f"ForEach({item.loop!r}) has no count in workflow.loops")
                    walk(item.body, (*scope, item.loop))
                else:
                    out.append((item, scope))

        walk(self.body, (ITERATION,))
        return out

    def op(self, name: str) -> OpSpec:
        for op, _ in self.ops_with_scope():
            if op.name == name:
                return op
        raise KeyError(f"workflow {self.name} has no op {name!r}")

    def replace_loops(self, **counts: int) -> Workflow:
        """The same workflow with some loop counts changed (e.g. the env-group count)."""
        unknown = set(counts) - set(self.loops)
        if unknown:
            raise WorkflowError(f"workflow {self.name} has no loops {sorted(unknown)}")
        return Workflow(self.name, self.components, self.states, {**self.loops, **counts}, self.body,
                        self.version_order)
