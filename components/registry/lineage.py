"""Lineage: what a model was built from, logged as tags on every training run."""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Lineage:
    git_commit: str
    snapshot_hash: str
    lancedb_version: int
    params_hash: str
    episodes: int
    frames: int
    episodes_per_robot: dict[str, int] = field(default_factory=dict)
    # the registered champion when it was trained (-1: none): the weights a train task fine-tunes
    # and the version whose failures FERT queries (``fert.failures_from: champion``)
    champion_version: int = -1
    # how to rebuild it: "train-task" = the flow's train task on one process, which
    # ``fleetloop reproduce`` repeats; "" = another path (the fleet's async trainer, torchrun)
    recipe: str = ""
    snapshot_remote: str = ""  # the DVC remote the snapshot was pushed to ("" = the root's cache only)

    def tags(self) -> dict[str, str]:
        tags = {f"fleetloop.{k}": str(v) for k, v in asdict(self).items() if k != "episodes_per_robot"}
        tags["fleetloop.episodes_per_robot"] = json.dumps(self.episodes_per_robot, sort_keys=True)
        return tags

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> "Lineage":
        def get(key: str, default: str = "") -> str:
            return tags.get(f"fleetloop.{key}", default)

        return cls(
            git_commit=get("git_commit"),
            snapshot_hash=get("snapshot_hash"),
            lancedb_version=int(get("lancedb_version", "-1")),
            params_hash=get("params_hash"),
            episodes=int(get("episodes", "0")),
            frames=int(get("frames", "0")),
            episodes_per_robot=json.loads(get("episodes_per_robot", "{}")),
            champion_version=int(get("champion_version", "-1")),
            recipe=get("recipe"),
            snapshot_remote=get("snapshot_remote"),
        )


def git_commit(cwd: Path) -> str:
    """HEAD of the repository holding ``cwd`` (suffixed ``-dirty`` with uncommitted changes)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def params_hash(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]
