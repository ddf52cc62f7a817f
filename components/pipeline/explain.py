"""Explain step: the failure explorer (components/fert/explorer.py) for one registered model version.

    version (number or alias) --registry--> its MLflow run: fert/retrieval.json (what the train
        step's FERT retrieval used) + evaluation.json (the candidate's evaluation, by stage) +
        champion_evaluation.json (the champion before it, on the same trials, when there was one)
    --lineage--> the dataset it trained on: the first ``lineage.episodes`` stored episodes (the
        dataset only appends, in episode_index order)
    --explorer--> pages + stage table under <root>/artifacts/explain/v<N> (or ``out_dir``)

The retrain flow calls ``explain_candidate`` (and logs the folder onto the run as ``explain/``),
`fleetloop explain VERSION` calls ``explain_version``: one path, the same pictures.
"""

from __future__ import annotations

from pathlib import Path

from components.config import Settings
from components.episodes.record import Episode
from components.fert.explorer import CameraFrames, Explanation, StageCounts, explain
from components.fert.retrieval_record import ARTIFACT as RETRIEVAL_ARTIFACT
from components.fert.retrieval_record import RetrievalRecord
from components.pipeline.promote import CHAMPION_EVALUATION_ARTIFACT
from components.pipeline.workspace import Workspace
from components.registry.lineage import Lineage
from components.registry.model_registry import PolicyVersion
from components.sim.factory import stages, workspace_view

EXPLAIN_DIR = "explain"  # on the run, and under <root>/artifacts
RETRIEVAL_METHODS = ("fert", "fert_uniform")


class NothingToExplain(RuntimeError):
    """The version cannot be explained: what is wrong (the message) and how to fix it (``fix``)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def default_out_dir(settings: Settings, version: int) -> Path:
    return settings.paths.artifacts / EXPLAIN_DIR / f"v{version}"


def load_record(ws: Workspace, mv: PolicyVersion) -> RetrievalRecord:
    """The retrieval record the version's train step kept; one line + fix when it has none."""
    method = mv.tags.get("fleetloop.method", "unknown")
    body = ws.registry.run_dict(mv.run_id, RETRIEVAL_ARTIFACT)
    if body is None and method not in RETRIEVAL_METHODS:
        raise NothingToExplain(f"version {mv.version} was trained with method {method}: no retrieval to explain",
                               "explain a version trained with train.method fert or fert_uniform (`fleetloop status` lists versions)")
    if body is None:
        raise NothingToExplain(f"version {mv.version} ({method}) has no {RETRIEVAL_ARTIFACT} on run {mv.run_id}: "
                               "it was trained before the retrieval record was kept",
                               "retrain (`fleetloop retrain`) and explain the new version")
    return RetrievalRecord.from_dict(body)


def trained_episodes(ws: Workspace, lineage: Lineage, version: int) -> list[Episode]:
    """The episodes the version trained on: the first ``lineage.episodes`` of the dataset."""
    stored = ws.dataset.num_episodes
    if stored < lineage.episodes:
        raise NothingToExplain(
            f"version {version} trained on {lineage.episodes} episodes (snapshot {lineage.snapshot_hash}) but "
            f"{ws.dataset.root} holds {stored}",
            f"restore that snapshot (`dvc checkout` of datasets/episodes.dvc with md5 {lineage.snapshot_hash}), then explain again")
    return list(ws.dataset.episodes(stop=lineage.episodes))


def explain_version(settings: Settings, version: str | int, out_dir: Path | None = None) -> Explanation:
    """Pictures + stage table for a registered version, from what its training kept."""
    ws = Workspace(settings)
    mv = ws.registry.resolve(version)
    record = load_record(ws, mv)
    tasks = {f.task for f in record.failures}
    if tasks and tasks != {settings.sim.task}:
        raise NothingToExplain(f"version {mv.version} was trained on task(s) {sorted(tasks)}, not sim.task={settings.sim.task!r}",
                               "run with the sim settings it was trained with (sim.name / sim.task in params.yaml)")
    after, champion = (_stage_counts(ws.registry.run_dict(mv.run_id, name))
                       for name in ("evaluation.json", CHAMPION_EVALUATION_ARTIFACT))
    episodes = trained_episodes(ws, mv.lineage, mv.version)
    return explain(record, episodes, stages(settings.sim), workspace_view(settings.sim), settings.explain,
                   out_dir or default_out_dir(settings, mv.version), after, champion, stored_camera_frames(ws, episodes))


def stored_camera_frames(ws: Workspace, episodes: list[Episode]) -> CameraFrames | None:
    """An episode's camera frames decoded from the dataset, only for the episodes a page shows
    (None when the dataset stores no camera streams: the pages are drawn without strips)."""
    if not ws.dataset.camera_keys:
        return None
    index = {ep.episode_id: i for i, ep in enumerate(episodes)}  # the first episodes of the dataset, in order
    return lambda episode_id: ws.dataset.camera_frames(index[episode_id])


def _stage_counts(evaluation: dict | None) -> StageCounts | None:
    """An evaluation kept on a run (``EvaluationReport.to_dict``) as failures by stage."""
    return StageCounts(dict(evaluation["failures_by_stage"]), int(evaluation["trials"])) if evaluation else None


def explain_candidate(settings: Settings, version: int) -> Explanation | None:
    """The retrain flow's step: explain a freshly registered fert version and log the folder onto
    its run as ``explain/``. None when ``explain.enabled`` is off or the method retrieves nothing."""
    if not settings.explain.enabled:
        return None
    ws = Workspace(settings)
    mv = ws.registry.get_version(version)
    if mv.tags.get("fleetloop.method") not in RETRIEVAL_METHODS:
        return None
    explanation = explain_version(settings, version)
    ws.registry.log_run_folder(mv.run_id, Path(explanation.out_dir), EXPLAIN_DIR)
    return explanation
