"""Flows pass references, not payloads (DESIGN.md, "Flow boundaries").

Prefect stores every flow run's parameters in its database (its server refuses a run whose
parameters pass 512 KB: `make demo` died of it at round 1 when `promote` took the whole
`TrainOutcome`) and persists what a flow or a caching task returns. Two guards:

- the types: every ``@flow`` in ``flows/`` and every task whose result Prefect persists is walked
  for parameter and return types that can carry a payload (a tensor, a module, an array, a table,
  an episode), through dataclass fields, pydantic models and containers;
- the sizes: a real round at 96 robots (FERT, with retrieval) through the flows, then every flow
  run's parameters as the Prefect API stored them and every flow's persisted result, measured.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import types
import typing
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml

import flows
from components.config import DemoConfig, EvaluationConfig, FleetConfig, TrainConfig
from components.episodes.record import Episode
from tests.conftest import small_settings

PAYLOAD_TYPES = (torch.Tensor, torch.nn.Module, np.ndarray, pa.Table, pa.RecordBatch, Episode)
ROOM = 64 * 1024  # bytes: Prefect's limit is 512 KB; a reference-sized boundary stays far below it
FLEET = 96
PARAMS = yaml.safe_load((Path(__file__).resolve().parent.parent / "params.yaml").read_text())  # the round's real shape


def _flow_modules() -> list[types.ModuleType]:
    return [importlib.import_module(f"flows.{m.name}") for m in pkgutil.iter_modules(flows.__path__)]


def _prefect_objects(kind: type) -> dict[str, typing.Any]:
    found = {}
    for module in _flow_modules():
        for name, obj in vars(module).items():
            if isinstance(obj, kind) and obj.fn.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def payload_paths(hint: typing.Any, path: str = "", seen: frozenset = frozenset()) -> list[str]:
    """Where a type hint can hold a payload: ``["outcome.result.policy: Module"]``; [] when it cannot."""
    origin = typing.get_origin(hint)
    if origin is not None:  # list[X], X | None, dict[K, V], tuple[...], Annotated, Literal
        if origin is typing.Literal:
            return []
        return [p for arg in typing.get_args(hint) for p in payload_paths(arg, path, seen)]
    if not isinstance(hint, type) or hint in seen:
        return []
    if issubclass(hint, PAYLOAD_TYPES):
        return [f"{path or '<value>'}: {hint.__name__}"]
    seen = seen | {hint}
    fields: dict[str, typing.Any] = {}
    if dataclasses.is_dataclass(hint):
        fields = typing.get_type_hints(hint)
    elif hasattr(hint, "model_fields"):  # pydantic (Settings and its sections)
        fields = {name: f.annotation for name, f in hint.model_fields.items()}
    return [p for name, sub in fields.items() for p in payload_paths(sub, f"{path}.{name}".lstrip("."), seen)]


def _signature_payloads(fn) -> list[str]:
    hints = typing.get_type_hints(fn)
    return [f"{fn.__module__}.{fn.__name__}({where})" for name, hint in hints.items()
            for where in payload_paths(hint, "return" if name == "return" else name)]


def test_the_walk_finds_payloads_behind_fields_and_containers():
    """The guard itself can fail: the signature `promote` had, and a list of episodes, are caught."""
    from components.pipeline.steps import TrainOutcome

    assert "outcome.result.policy: NormalizedPolicy" in payload_paths(TrainOutcome, "outcome")  # a torch Module
    assert payload_paths(list[Episode] | None, "episodes") == ["episodes: Episode"]
    assert payload_paths(dict[str, torch.Tensor], "state") == ["state: Tensor"]
    assert payload_paths(list[Path] | None, "files") == [] and payload_paths(str, "model_uri") == []


def test_every_flow_signature_takes_and_returns_references():
    found = _prefect_objects(__import__("prefect").Flow)
    names = {name.rsplit(".", 1)[1] for name in found}
    assert {"retrain", "train", "evaluate", "promote", "ingest", "fleet_round", "bootstrap", "store_upkeep",
            "rollback"} <= names, names  # the walk sees the flows (explain and demo drive tasks and flows)
    offenders = [p for f in found.values() for p in _signature_payloads(f.fn)]
    assert not offenders, f"flow parameters or results that can carry a payload: {offenders}"


def test_every_task_whose_result_prefect_keeps_returns_references():
    """A task with a cache key or ``persist_result=True`` has its result written to Prefect's storage."""
    tasks = _prefect_objects(__import__("prefect").Task)
    kept = {name: t for name, t in tasks.items() if t.persist_result or t.cache_key_fn is not None}
    assert {"flows.train.train_task", "flows.evaluate.rollout_task", "flows.fleet_round.collect_fleet_task"} <= set(kept)
    offenders = [f"{name}: {p}" for name, t in kept.items()
                 for p in payload_paths(typing.get_type_hints(t.fn).get("return"), "return")]
    unannotated = [name for name, t in kept.items() if "return" not in typing.get_type_hints(t.fn)]
    assert not unannotated, f"persisted tasks must say what they return (the walk reads it): {unannotated}"
    assert not offenders, f"persisted task results that can carry a payload: {offenders}"


def _round_settings(root: Path):
    return small_settings(
        root,
        demo=DemoConfig(expert_robots=4, expert_episodes_per_robot=8, rounds=1),
        fleet=FleetConfig(num_robots=FLEET, num_heldout_robots=4, steps_per_robot=PARAMS["fleet"]["steps_per_robot"]),
        train=TrainConfig(method="fert", epochs=1, batch_size=256, steps_per_iteration=20, validation_robots=1),
        evaluation=EvaluationConfig(trials_per_robot=4, trials_per_task=16),
    )


def _stored_runs() -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(limit=200)


def _result_bytes(flow_run) -> int:
    """The size of what Prefect persisted as this run's result (a result record in local storage)."""
    key = getattr(flow_run.state.data, "storage_key", None) if flow_run.state is not None else None
    assert key is not None, f"{flow_run.name}: no persisted result ({flow_run.state})"
    return Path(key).stat().st_size


@pytest.mark.slow
def test_a_fleet_round_at_96_robots_crosses_every_flow_boundary_with_room_to_spare(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_RESULTS_PERSIST_BY_DEFAULT, temporary_settings

    from flows.fleet_round import bootstrap, fleet_round

    settings = _round_settings(tmp_path)
    with temporary_settings(updates={PREFECT_RESULTS_PERSIST_BY_DEFAULT: True}):  # every flow's result is written
        before = {run.id for run in _stored_runs()}
        bootstrap(settings)
        collected, promotion = fleet_round(1, FLEET, settings)
        runs = [run for run in _stored_runs() if run.id not in before]

    assert collected.episodes >= 5 * FLEET  # the real shape: about a thousand episode files in the round
    assert promotion.training is not None and promotion.training.method == "fert"
    assert promotion.training.retrieved_segments > 0  # FERT retrieved for the champion's failures
    flows_run = {run.flow_id for run in runs}
    largest: dict[str, tuple[int, int]] = {}
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        names = {fid: client.read_flow(fid).name for fid in flows_run}
    for run in runs:
        params = len(json.dumps(run.parameters).encode())
        result = _result_bytes(run)
        name = names[run.flow_id]
        old = largest.get(name, (0, 0))
        largest[name] = (max(old[0], params), max(old[1], result))
    print("largest flow parameters and results (bytes):", json.dumps(largest, indent=1))  # noqa: T201
    assert {"bootstrap", "fleet_round", "retrain", "ingest", "train", "evaluate", "promote"} <= set(largest), largest
    too_big = {name: sizes for name, sizes in largest.items() if max(sizes) >= ROOM}
    assert not too_big, f"flow parameters/results over {ROOM} bytes: {too_big}"
