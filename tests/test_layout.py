"""The layout holds (issue 49): the imports of `components/` form no cycle, no room imports a room
above it, `components/` never imports Prefect or the outer folders, and every room has its line in
the map (docs/architecture.md). Imports are read from the source (every ``import``, at module
level or inside a function, and ``importlib.import_module("components....")`` strings); only
``if TYPE_CHECKING:`` blocks are skipped, as they never run."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMPONENTS = REPO / "components"
MAP = REPO / "docs" / "architecture.md"

# The layer order, written once: a room may import rooms of lower layers (later rows) only.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("fleet",),                                # FATS services and the chaos harness: run the pipeline
    ("pipeline",),                             # the steps the flows and `dvc repro` call
    ("fert",),                                 # training sets from failures: retrieval over the store
    ("training", "evaluation", "registry"),    # the one trainer, held-out evaluation, the MLflow registry
    ("sim", "store", "policy"),                # simulators, the LanceDB segment store, policy networks
    ("episodes", "shuffle", "scheduler"),      # the dataset, the MoE token shuffle, the scheduler
    ("config", "fsio"),                        # one typed Settings; atomic writes
)
LAYER_OF = {room: depth for depth, rooms in enumerate(LAYERS) for room in rooms}
NEVER_IMPORTED = ("prefect", "flows", "cli", "benchmarks", "tests")


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(COMPONENTS.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    return skipped


def imports_of(path: Path, module: str, modules: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in ``path`` that runs; ``modules``: the names that
    are modules (so ``from package import submodule`` names the submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:  # `from package import submodule` depends on the submodule only
                submodule = f"{base}.{alias.name}"
                yield (submodule if submodule in modules else base), node.lineno
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, node.lineno


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "components" and len(parts) > 1 else None


def _graph() -> dict[str, dict[str, int]]:
    """module -> {components module it imports: line}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        graph[module] = {}
        for name, line in imports_of(path, module, set(modules)):
            if name in modules and name != module:
                graph[module].setdefault(name, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_every_room_has_a_layer():
    rooms = {p.stem if p.is_file() else p.name for p in COMPONENTS.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert rooms == set(LAYER_OF), f"rooms without a layer: {rooms - set(LAYER_OF)}; layers without a room: {set(LAYER_OF) - rooms}"


def test_components_import_no_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (move what both sides need to the lower module): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_no_room_imports_a_room_above_it():
    upward = []
    for module, targets in _graph().items():
        source = _room(module)
        for target, line in targets.items():
            room = _room(target)
            if source and room and room != source and LAYER_OF[room] < LAYER_OF[source]:
                upward.append(f"{module}:{line} imports {target} ({source} is below {room})")
    assert not upward, "\n".join(upward)


def test_components_never_import_prefect_or_the_outer_folders():
    found = [f"{path.relative_to(REPO)}:{line} imports {name}"
             for module, path in _modules().items() for name, line in imports_of(path, module)
             if name.split(".")[0] in NEVER_IMPORTED]
    assert not found, "\n".join(found)


def _map_lines() -> set[str]:
    """The folders and modules the map names at the start of a line: `components/NAME`."""
    return set(re.findall(r"^\|?\s*`components/([a-z_]+(?:/[a-z_]+)?)(?:\.py)?/?`", MAP.read_text(), flags=re.M))


@pytest.mark.parametrize("folder", sorted(
    str(p.relative_to(COMPONENTS)) for p in COMPONENTS.rglob("*") if p.is_dir() and (p / "__init__.py").exists()))
def test_every_components_folder_has_a_line_in_the_map(folder):
    assert folder in _map_lines(), f"docs/architecture.md has no line for components/{folder}/ (add one to its room table)"


def test_the_checks_can_fail(tmp_path):
    """The walker sees function-level and import_module imports, skips TYPE_CHECKING, and finds a
    planted cycle."""
    source = tmp_path / "steps.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from components.fleet.chaos import ChaosRun\n"
        "def later():\n    from components.fleet import local\n"
        "def lazily():\n    return importlib.import_module('components.store.resident')\n"
        "from . import workspace\n"
    )
    names = {name for name, _ in imports_of(source, "components.pipeline.steps", set(_modules()))}
    assert {"components.fleet.local", "components.store.resident",
            "components.pipeline.workspace"} <= names
    assert "components.fleet.chaos" not in names
    graph = {"components.a.x": {"components.b.y": 1}, "components.b.y": {"components.a.x": 3}, "components.c": {}}
    assert _cycles(graph) == [["components.a.x", "components.b.y"]]
