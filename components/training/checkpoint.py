"""Atomic training checkpoints: weights, optimizer, every RNG, and the data cursor, in one file.

    save: torch.save -> <dir>/.step-N.pt.<pid>.tmp -> flush + fsync -> os.replace -> fsync(dir)
    load: the newest ``step-*.pt`` that loads (``weights_only=True``: a checkpoint cannot run code)

A crash (even SIGKILL) mid-save leaves the previous checkpoint intact and at worst a stray temp
file, removed on the next save. ``keep`` newest checkpoints are kept. Restoring RNG states makes
the steps after a resume draw exactly the batches they would have drawn.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components.fsio import atomic_path

log = logging.getLogger(__name__)

NAME = "step-{step:09d}.pt"
PATTERN = re.compile(r"^step-(\d{9})\.pt$")
TMP_GLOB = ".step-*.tmp"


@dataclass
class TrainingCheckpoint:
    """Everything needed to continue training as if it had never stopped."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    cursor: dict[str, int]  # where the data stream was (e.g. episodes consumed)
    extra: dict[str, Any] = field(default_factory=dict)  # loss curve, resume log, ...


def capture_rng(generator: torch.Generator | None = None, numpy_rng: np.random.Generator | None = None) -> dict[str, Any]:
    """Python, numpy (global and ``numpy_rng``), torch CPU and ``generator`` states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy_global": _numpy_global_state(),
        "torch": torch.get_rng_state(),
    }
    if generator is not None:
        state["generator"] = generator.get_state()
    if numpy_rng is not None:
        state["numpy_rng"] = numpy_rng.bit_generator.state
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_global_state() -> dict[str, Any]:
    """The legacy global MT19937 state with its key as a plain list (loadable with weights_only)."""
    state = np.random.get_state(legacy=False)
    inner = dict(state["state"])
    inner["key"] = [int(v) for v in inner["key"]]
    return {**state, "state": inner}


def _set_numpy_global_state(state: dict[str, Any]) -> None:
    inner = dict(state["state"])
    inner["key"] = np.asarray(inner["key"], dtype=np.uint32)
    np.random.set_state({**state, "state": inner})


def restore_rng(state: dict[str, Any], generator: torch.Generator | None = None, numpy_rng: np.random.Generator | None = None) -> None:
    random.setstate(state["python"])
    _set_numpy_global_state(state["numpy_global"])
    torch.set_rng_state(state["torch"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])
    if numpy_rng is not None and "numpy_rng" in state:
        numpy_rng.bit_generator.state = state["numpy_rng"]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder: Path, checkpoint: TrainingCheckpoint, keep: int = 3) -> Path:
    """Write ``checkpoint`` atomically; keep the newest ``keep``; returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stray in folder.glob(TMP_GLOB):
        stray.unlink(missing_ok=True)
    path = folder / NAME.format(step=checkpoint.step)
    payload = {
        "step": checkpoint.step,
        "model": checkpoint.model,
        "optimizer": checkpoint.optimizer,
        "rng": checkpoint.rng,
        "cursor": checkpoint.cursor,
        "extra": checkpoint.extra,
    }
    with atomic_path(path) as tmp:  # .<name>.<pid>.tmp, which TMP_GLOB sweeps after a crash
        torch.save(payload, tmp)
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    folder = Path(folder)
    if not folder.exists():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path) -> TrainingCheckpoint:
    raw = torch.load(path, map_location="cpu", weights_only=True)
    return TrainingCheckpoint(
        step=int(raw["step"]), model=raw["model"], optimizer=raw["optimizer"], rng=raw["rng"],
        cursor=dict(raw["cursor"]), extra=dict(raw.get("extra", {})),
    )


def load_latest(folder: Path) -> TrainingCheckpoint | None:
    """The newest readable checkpoint (an unreadable one is logged and skipped), or None."""
    for path in reversed(list_checkpoints(folder)):
        try:
            return load_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - fall back to the previous checkpoint
            log.error("checkpoint %s unreadable (%s: %s); trying an older one", path, type(exc).__name__, exc)
    return None


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state_dict's names, dtypes, shapes and bytes: equal digests = bit-identical weights."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()
