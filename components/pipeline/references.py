"""What crosses a flow boundary: small references to payloads that stay where they are kept.

Prefect stores every flow run's parameters in its database (its server refuses a run whose
parameters pass 512 KB) and persists cached task results, so the flows hand each other names,
never models, training sets, retrieval records or episodes:

    train    -> CandidateRef   the trained, not yet registered policy, staged as one file under
                               ``<root>/artifacts/candidates/<weights digest>.pt``; promote
                               registers it in MLflow, which keeps it from then on
    evaluate <- model URI      ``models:/fleetloop-policy/N`` (a registered version) or
                               ``candidate:<path>`` (a staged candidate); loaded where it runs
    ingest   -> IngestSummary  counts, DVC snapshot hash, LanceDB version (the episodes stay in
                               the dataset, the quarantined files beside their reason files)
    collect  -> the round's folder (``CollectResult.reference()``), not its file list

The plain steps (``loop.plain_retrain_steps``) still pass values in one process: only the
boundaries Prefect records take these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from components.config import Settings
from components.episodes.quarantine import QuarantinedFile
from components.fsio import atomic_path
from components.pipeline.ingest import EPISODE_SUFFIXES, IngestResult
from components.pipeline.outcome import TrainingSummary, TrainOutcome
from components.policy.normalizer import NormalizedPolicy
from components.training.checkpoint import state_digest

CANDIDATE_SCHEME = "candidate:"
REGISTRY_SCHEME = "models:/"
# an ingest summary lists this many quarantined files (~300 bytes each); the rest are counted, and
# every one is under datasets/quarantine beside its reason file
LISTED_QUARANTINED = 50


class ReferenceError(ValueError):
    """A reference whose payload is not where it points."""


@dataclass(frozen=True)
class CandidateRef:
    """A trained policy staged for promotion, and the few figures the UI and the demo table show."""

    path: str  # the staged TrainOutcome (torch.save)
    digest: str  # of the weights: the same weights are the same file
    method: str
    frames: int
    final_loss: float
    seconds: float
    summary: TrainingSummary | None = None  # without per-step series (those go to the MLflow run)

    @property
    def model_uri(self) -> str:
        return f"{CANDIDATE_SCHEME}{self.path}"

    def exists(self) -> bool:
        return Path(self.path).is_file()


def stage_candidate(settings: Settings, outcome: TrainOutcome) -> CandidateRef:
    """Write ``outcome`` under ``artifacts/candidates`` (atomically) and return its reference."""
    digest = state_digest(outcome.result.policy.state_dict())
    path = settings.paths.artifacts / "candidates" / f"{digest[:24]}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(outcome, tmp)
    summary = outcome.summary
    return CandidateRef(
        str(path), digest, summary.method if summary else settings.train.method, outcome.frames,
        float(outcome.result.final_loss), float(outcome.result.seconds), brief_summary(summary),
    )


def load_candidate(ref: CandidateRef | str) -> TrainOutcome:
    path = Path(ref.path if isinstance(ref, CandidateRef) else ref)
    if not path.is_file():
        raise ReferenceError(f"staged candidate {path} is gone (removed by hand or by `make clean`?): "
                             "run `fleetloop retrain` again to train it anew")
    return torch.load(path, map_location="cpu", weights_only=False)


def brief_summary(summary: TrainingSummary | None) -> TrainingSummary | None:
    """``summary`` without the MoE per-step series (steps x experts numbers): the run means stay."""
    if summary is None or summary.expert_usage is None:
        return summary
    usage = {k: summary.expert_usage[k] for k in ("experts", "steps", "mean_share", "mean_dropped_rate")}
    return replace(summary, expert_usage=usage)


def load_model(settings: Settings, uri: str) -> NormalizedPolicy:
    """The policy a model URI names: a staged candidate or any URI the registry resolves."""
    if uri.startswith(CANDIDATE_SCHEME):
        return load_candidate(uri[len(CANDIDATE_SCHEME):]).result.policy
    from components.pipeline.workspace import Workspace

    return Workspace(settings).registry.load_uri(uri)


def model_fingerprint(settings: Settings, uri: str) -> str:
    """What identifies the weights behind ``uri`` without loading them: a candidate's file name is its
    weights digest; a registered version's MLflow run id is unique (version numbers restart with a
    new registry, run ids do not)."""
    if uri.startswith(CANDIDATE_SCHEME):
        return Path(uri[len(CANDIDATE_SCHEME):]).stem
    name_version = uri[len(REGISTRY_SCHEME):] if uri.startswith(REGISTRY_SCHEME) else ""
    version = name_version.rpartition("/")[2]
    if not version.isdigit():
        raise ReferenceError(f"model URI {uri!r}: pass a registered version (models:/NAME/N) or a staged candidate "
                             "(candidate:PATH); an alias moves, so it cannot key a cached evaluation")
    from components.pipeline.workspace import Workspace

    return Workspace(settings).registry.get_version(int(version)).run_id


@dataclass(frozen=True)
class IngestSummary:
    """What an ingest did, in counts; the episodes are in the dataset, quarantined files beside their reasons."""

    added: int
    duplicates: int
    quarantined_total: int
    frames_added: int
    snapshot: str  # DVC snapshot hash, "" = no new snapshot
    store_version: int
    segments_upserted: int
    text: str  # IngestReport.summary()
    quarantined: tuple[QuarantinedFile, ...] = ()  # the first LISTED_QUARANTINED

    @classmethod
    def of(cls, result: IngestResult) -> IngestSummary:
        report = result.report
        return cls(len(report.added), len(report.duplicates), len(report.quarantined), report.frames_added,
                   result.snapshot.hash if result.snapshot else "", result.store_version, result.segments_upserted,
                   report.summary(), tuple(report.quarantined[:LISTED_QUARANTINED]))

    @property
    def unlisted(self) -> int:
        return self.quarantined_total - len(self.quarantined)


def episode_files(paths: Iterable[Path]) -> list[Path]:
    """Files as given; a folder stands for the episode files under it (sorted: reproducible runs)."""
    out: list[Path] = []
    for path in map(Path, paths):
        out += sorted(p for p in path.rglob("*") if p.suffix in EPISODE_SUFFIXES) if path.is_dir() else [path]
    return out
