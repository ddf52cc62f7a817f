"""What a chaos run found: the fault log (``Fault``, ``Revocation``, ``TimelinePoint``), the
``ChaosReport``, and the ``audit`` that builds it from disk only: every robot's ledger, pending and
rejected spool against the dataset (finished, stored, duplicated, lost, corrupted, latency), and the
trainer's resumes with its loss curve around each (chaos.py runs the faults)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from components.config import Settings
from components.fleet.layout import RuntimeLayout
from components.fleet.spool import Spool
from components.fleet.trainer import STATUS_NAME

LOSS_WINDOW = 5  # steps averaged before/after a resume in the report
RATE_WINDOW_S = 60.0  # restart rates are counted per minute


@dataclass(frozen=True)
class ScheduledFault:
    at_s: float  # seconds after the fleet came up
    kind: str


@dataclass(frozen=True)
class Fault:
    at_s: float  # when it was injected
    kind: str
    target: str  # member name, proxy, the ingest, a robot
    pid: int = 0
    detail: str = ""


@dataclass(frozen=True)
class Revocation:
    robot: str
    at_s: float
    seconds: float  # revoked this long
    restarts: int  # the coordinator restarted it this often meanwhile
    failures: int | None = None  # its failures in a row when re-admitted (None: no longer a member)
    delays: list[float] = field(default_factory=list)  # the restart delays of those failures


@dataclass(frozen=True)
class TimelinePoint:
    t_s: float
    finished: int  # robots' own counts (heartbeats)
    stored: int  # finished minus still pending, per robot
    champion: int | None
    restarts: int  # all members, carried over coordinator restarts


@dataclass
class ChaosReport:
    robots: int
    duration_s: float
    seed: int = 0
    finished: int = 0
    stored: int = 0  # of those finished
    stored_before: int = 0  # in the dataset, finished by no robot of this run (the root's earlier data)
    duplicated: int = 0
    lost: int = 0
    corrupted: int = 0
    interrupted: int = 0
    schedule: list[ScheduledFault] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # scheduled kinds that never became possible
    revocations: list[Revocation] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    restarts_total: int = 0
    max_member_restarts_per_min: int = 0  # the worst member, in any 60-s window
    max_fleet_restarts_per_min: int = 0  # all members together, in any 60-s window
    latency_s: dict[str, float] = field(default_factory=dict)  # spooled -> stored: p50, p99, max
    champion_versions: list[int] = field(default_factory=list)  # in the order they served
    promotions: int = 0  # champion changes during the run
    timeline: list[TimelinePoint] = field(default_factory=list)
    proxy: dict[str, dict] = field(default_factory=dict)
    trainer_steps: int = 0
    trainer_resumes: list[int] = field(default_factory=list)
    trainer_method: str = ""  # what the trainer imitated (train.method: fert by default)
    trainer_pin: dict | None = None  # what its last training set was built from (fleet/training_set.py)
    loss_around_resumes: list[dict] = field(default_factory=list)
    loss_steps_contiguous: bool = False
    completed: bool = False  # the drain finished: every robot uploaded everything
    leaked_pids: list[int] = field(default_factory=list)
    outlived_coordinator: int = 0  # members still running stop_grace_s * 2 after a coordinator SIGKILL
    outlived: list[str] = field(default_factory=list)  # which ones, and how long after the kill they were gone
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def trainer_status(layout: RuntimeLayout) -> dict:
    path = layout.state / STATUS_NAME
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def max_in_window(series: list[tuple[float, int]], window_s: float) -> int:
    """The largest increase of a non-decreasing counter ``[(t, count), ...]`` within any ``window_s``."""
    best, start = 0, 0
    for t, count in series:
        while series[start][0] < t - window_s:
            start += 1
        best = max(best, count - series[start][1])
    return best


def audit(settings: Settings, report: ChaosReport) -> ChaosReport:
    """Count finished / stored / duplicated / lost / corrupted (and latency) from what is on disk."""
    from components.episodes.dataset import EpisodeDataset
    from components.episodes.schema import episode_to_table
    from components.episodes.validation import validate_episode_table

    layout = RuntimeLayout.of(settings)
    finished: dict[str, str] = {}
    latencies: list[float] = []
    for robot in settings.fleet.robot_ids():
        spool = Spool(layout.spool(robot))
        finished.update(spool.finished())
        latencies += [e.acked_at - e.finished_at for e in spool.ledger() if e.acked_at is not None and e.finished_at is not None]
    dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
    meta = dataset.episodes_meta()
    ids = meta.column("episode_id").to_pylist() if meta is not None else []
    hashes = meta.column("content_hash").to_pylist() if meta is not None else []
    stored = dict(zip(ids, hashes))
    corrupted = {i for i, h in stored.items() if i in finished and finished[i] != h}
    for episode in dataset.episodes():  # every stored episode must still read back and validate
        try:
            validate_episode_table(episode_to_table(episode), None, None, None, f"stored {episode.episode_id}")
        except ValueError:
            corrupted.add(episode.episode_id)
    report.finished = len(finished)
    report.stored = len(set(finished) & set(ids))
    report.stored_before = len(set(ids) - set(finished))
    report.duplicated = len(ids) - len(set(ids))
    report.lost = len(set(finished) - set(stored))
    report.corrupted = len(corrupted)
    report.interrupted = int(np.sum(meta.column("interrupted").to_numpy(zero_copy_only=False))) if meta is not None else 0
    if latencies:
        report.latency_s = {q: round(float(np.percentile(latencies, p)), 3) for q, p in (("p50", 50), ("p99", 99), ("max", 100))}
    _audit_trainer(layout, report)
    return report


def _audit_trainer(layout: RuntimeLayout, report: ChaosReport) -> None:
    """Resumes and the loss curve around each, from the newest checkpoint."""
    from components.training.checkpoint import load_latest

    ckpt = load_latest(layout.checkpoints)
    if ckpt is None:
        return
    losses = [(int(s), float(v)) for s, v in ckpt.extra.get("losses", [])]
    steps = [s for s, _ in losses]
    report.trainer_steps = ckpt.step
    report.trainer_resumes = [int(r) for r in ckpt.extra.get("resumes", [])]
    report.trainer_pin = ckpt.extra.get("pin")
    report.trainer_method = (trainer_status(layout).get("training_set") or {}).get("method", "")
    report.loss_steps_contiguous = steps == list(range(1, len(steps) + 1))
    by_step = dict(losses)

    def mean(first: int, last: int) -> float | None:
        values = [by_step[s] for s in range(max(1, first), last + 1) if s in by_step]
        return float(np.mean(values)) if values else None

    for resume in report.trainer_resumes:
        report.loss_around_resumes.append(
            {
                "resume_step": resume,
                "first_steps_mean": mean(1, LOSS_WINDOW),
                "before_mean": mean(resume - LOSS_WINDOW + 1, resume),
                "after_mean": mean(resume + 1, resume + LOSS_WINDOW),
            }
        )

