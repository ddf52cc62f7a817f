"""What one FERT training set was built from, small enough to keep with the model.

    MethodTrainingSet (the trainer's FERT path: contexts + Retrieved)
      --RetrievalRecord.from_training_set-->  failures (episode, robot, divergence step, fallback)
                                              + kept matches (query window, success segment, distance)
      --to_dict / from_dict-->                fert/retrieval.json on the model's MLflow run

The failure explorer (``explorer.py``) renders from this record and the episodes it names; it never
runs retrieval again, so the pictures show exactly what the trainer used. Matches are stored as
columns (one list per field) to keep the JSON small: ``max_queries`` x ``top_k`` rows at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from components.fert.methods import MethodTrainingSet

ARTIFACT = "fert/retrieval.json"  # where the record lives on the model's MLflow run
RECORD_VERSION = 1  # bump when the JSON layout changes (from_dict refuses other versions)
MATCH_FIELDS = ("failure", "query_start", "episode_id", "robot_id", "start", "end", "distance")


@dataclass(frozen=True)
class FailureRecord:
    """One failed episode that queried: where it diverged (or fell back) and how many windows it had."""

    episode_id: str
    robot_id: str
    task: str
    divergence_step: int
    fallback: bool
    windows: int


@dataclass(frozen=True)
class MatchRecord:
    """One kept match: the failure's query window [query_start, query_start + window) found the
    success segment [start, end) of ``episode_id`` at ``distance`` (plain length, not squared)."""

    failure: str
    query_start: int
    episode_id: str
    robot_id: str
    start: int
    end: int
    distance: float


@dataclass(frozen=True)
class RetrievalRecord:
    method: str
    seed: int
    window: int  # frames per query window (store.window)
    store_version: int
    threshold: float | None  # divergence threshold (store metric); None with several tasks
    consecutive: int | None
    cutoff: float  # matches farther than this (store metric) were dropped
    num_queries: int
    failures: tuple[FailureRecord, ...]
    matches: tuple[MatchRecord, ...]

    @classmethod
    def from_training_set(cls, built: MethodTrainingSet, seed: int, window: int) -> RetrievalRecord | None:
        """The record of a fert / fert_uniform training set; None for methods without retrieval."""
        retrieved = built.retrieved
        if retrieved is None:
            return None
        distances = retrieved.euclidean()
        matches = tuple(
            MatchRecord(str(f), int(q), str(e), str(r), int(s), int(t), float(d))
            for f, q, e, r, s, t, d in zip(
                retrieved.query_episode_ids, retrieved.query_starts, retrieved.episode_ids, retrieved.robot_ids,
                retrieved.starts, retrieved.ends, distances, strict=True)
        )
        failures = tuple(
            FailureRecord(c.episode_id, c.robot_id, c.task, int(c.divergence_step), bool(c.fallback), len(c.starts))
            for c in built.contexts
        )
        threshold = built.report.threshold
        return cls(
            method=built.report.method, seed=seed, window=window, store_version=retrieved.store_version,
            threshold=None if threshold is None else float(threshold.distance),
            consecutive=None if threshold is None else int(threshold.consecutive),
            cutoff=float(retrieved.cutoff), num_queries=retrieved.num_queries, failures=failures, matches=matches,
        )

    def matches_of(self, failure: str) -> list[MatchRecord]:
        """The matches a failure's windows found, nearest first (ties: episode id, start)."""
        return sorted((m for m in self.matches if m.failure == failure), key=lambda m: (m.distance, m.episode_id, m.start))

    def episode_ids(self) -> set[str]:
        """Every episode the record names: the failures and the successes they retrieved."""
        return {f.episode_id for f in self.failures} | {m.episode_id for m in self.matches}

    def to_dict(self) -> dict:
        columns = {name: [getattr(m, name) for m in self.matches] for name in MATCH_FIELDS}
        return {
            "record_version": RECORD_VERSION, "method": self.method, "seed": self.seed, "window": self.window,
            "store_version": self.store_version, "threshold": self.threshold, "consecutive": self.consecutive,
            "cutoff": None if not np.isfinite(self.cutoff) else self.cutoff, "num_queries": self.num_queries,
            "failures": [f.__dict__ for f in self.failures], "matches": columns,
        }

    @classmethod
    def from_dict(cls, body: dict) -> RetrievalRecord:
        if body.get("record_version") != RECORD_VERSION:
            raise ValueError(
                f"retrieval record version {body.get('record_version')!r} is not {RECORD_VERSION}: "
                "it was written by another fleetloop; explain it with that version"
            )
        columns = body["matches"]
        rows = zip(*(columns[name] for name in MATCH_FIELDS), strict=True) if columns[MATCH_FIELDS[0]] else ()
        return cls(
            method=body["method"], seed=int(body["seed"]), window=int(body["window"]),
            store_version=int(body["store_version"]), threshold=body["threshold"], consecutive=body["consecutive"],
            cutoff=float("nan") if body["cutoff"] is None else float(body["cutoff"]), num_queries=int(body["num_queries"]),
            failures=tuple(FailureRecord(**f) for f in body["failures"]),
            matches=tuple(MatchRecord(*row) for row in rows),
        )
