"""Rebuild a registered model from what its lineage names, and check the weights: ``fleetloop reproduce``.

    version --registry--> lineage (recipe, DVC snapshot, store version, champion) + lineage/settings.json
      -> a scratch root: the episode dataset at the snapshot hash, pulled from the DVC remote it was
         pushed to (``episodes.dvc_remote``), else checked out of the root's DVC cache
      -> the training set as the train task built it (``steps.method_training_set``): the segment
         store at the version kept for the model (tag ``model-v<N>``), the champion's failures
      -> the one trainer (sequential plan: every plan gives the same weights, tested), fine-tuning
         the champion when the train task did
      -> the rebuilt weights' digest against the registered model's

Only the train task's models carry the recipe (``Lineage.recipe``); the fleet's async trainer and
``torchrun`` builds are refused with what their lineage does record. The code is today's checkout:
the report says whether it is the commit the model was trained at.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from components.config import Settings
from components.episodes.dataset import EpisodeDataset
from components.episodes.snapshot import (
    DvcRemote,
    checkout_from_cache,
    ensure_dvc_repo,
    pull_snapshot,
    write_snapshot_file,
)
from components.fert.corpus import DatasetCorpus
from components.pipeline.outcome import reads_cameras
from components.pipeline.recipe import SETTINGS_ARTIFACT, STORE_TAG
from components.pipeline.steps import (
    RETRIEVAL_METHODS,
    TRAIN_TASK_RECIPE,
    fine_tunable,
    method_training_set,
)
from components.pipeline.workspace import Workspace
from components.registry.lineage import Lineage, git_commit
from components.registry.model_registry import PolicyVersion, RegistryError
from components.store.segment_store import SegmentStore, table_exists
from components.training.checkpoint import state_digest
from components.training.trainer import make_trainer


class ReproduceError(RuntimeError):
    """A version that cannot be rebuilt; the message names what is missing and the fix."""


@dataclass(frozen=True)
class Reproduction:
    version: int
    trained_at_commit: str
    current_commit: str
    snapshot: str
    store_version: int | None  # None: the method reads no store
    champion: int | None  # the version it fine-tuned / took failures from
    episodes: int
    frames: int
    registered_digest: str
    rebuilt_digest: str
    seconds: float
    scratch: str

    @property
    def matches(self) -> bool:
        return self.registered_digest == self.rebuilt_digest

    @property
    def same_commit(self) -> bool:
        return self.trained_at_commit == self.current_commit

    def to_dict(self) -> dict:
        return {**asdict(self), "matches": self.matches, "same_commit": self.same_commit}


def reproduce_version(settings: Settings, version: str, scratch: Path,
                      log: Callable[[str], None] = lambda line: None) -> Reproduction:
    """Rebuild ``version`` (number or alias) of ``settings``' registry in ``scratch`` (a new or empty folder)."""
    start = time.perf_counter()
    registry = Workspace(settings).registry
    try:
        mv = registry.resolve(version)
    except RegistryError as exc:
        raise ReproduceError(str(exc)) from exc
    lineage = mv.lineage
    build = _recipe_settings(registry, mv, lineage, scratch)
    log(f"v{mv.version}: restoring DVC snapshot {lineage.snapshot_hash} into {scratch}"
        + (f" from {lineage.snapshot_remote}" if lineage.snapshot_remote else ""))
    dataset = restore_snapshot(settings, build, lineage)
    if dataset.num_episodes != lineage.episodes:
        raise ReproduceError(f"snapshot {lineage.snapshot_hash} holds {dataset.num_episodes} episodes, lineage of v{mv.version} "
                             f"says {lineage.episodes}: the model was trained on data ingested without a snapshot")
    store = kept_store(settings, build, mv.version, lineage) if build.train.method in RETRIEVAL_METHODS else None
    champion = lineage.champion_version if lineage.champion_version >= 0 else None
    failures_of = champion if build.fert.failures_from == "champion" else None
    built = method_training_set(build, DatasetCorpus(dataset, cameras=reads_cameras(build)), store, failures_of)
    init = fine_tunable(build, Workspace(build), registry.load(champion)) if champion is not None else None
    log(f"v{mv.version}: training {build.train.method} on {len(built.data.states)} frames"
        + (f", fine-tuning v{champion}" if init is not None else ""))
    run = make_trainer(build, built.data, init, log).run()
    return Reproduction(
        version=mv.version, trained_at_commit=lineage.git_commit, current_commit=git_commit(Path(__file__).parent),
        snapshot=lineage.snapshot_hash, store_version=store.version if store is not None else None, champion=champion,
        episodes=dataset.num_episodes, frames=len(built.data.states),
        registered_digest=state_digest(registry.load(mv.version).state_dict()),
        rebuilt_digest=state_digest(run.policy.state_dict()), seconds=time.perf_counter() - start, scratch=str(scratch),
    )


def _recipe_settings(registry, mv: PolicyVersion, lineage: Lineage, scratch: Path) -> Settings:
    """The settings v``mv`` was trained with, rooted at ``scratch``, on the sequential plan."""
    if lineage.recipe != TRAIN_TASK_RECIPE:
        raise ReproduceError(
            f"v{mv.version} was not built by the train task (lineage recipe {lineage.recipe or 'none'!r}: the fleet's "
            f"async trainer, torchrun or a version registered before recipes were kept); its lineage says "
            f"{lineage.episodes} episodes, store version {lineage.lancedb_version}, commit {lineage.git_commit[:12]}"
        )
    body = registry.run_dict(mv.run_id, SETTINGS_ARTIFACT)
    if body is None:
        raise ReproduceError(f"v{mv.version}'s run {mv.run_id} has no {SETTINGS_ARTIFACT}; it cannot be rebuilt")
    if scratch.exists() and any(scratch.iterdir()):
        raise ReproduceError(f"{scratch} is not empty; give `--scratch` a new folder")
    body["scheduler"]["plan"] = "sequential"  # same weights as any plan, without profiling in a fresh root
    return Settings(**body, root=scratch)


def restore_snapshot(source: Settings, build: Settings, lineage: Lineage) -> EpisodeDataset:
    """The dataset at the lineage's snapshot hash, in ``build``'s root: pulled from the DVC remote
    it was pushed to, else checked out of ``source``'s DVC cache."""
    from dvc.exceptions import DvcException

    snapshot_hash = lineage.snapshot_hash
    if not snapshot_hash.endswith(".dir"):
        raise ReproduceError(f"lineage names no DVC snapshot ({snapshot_hash!r}): the data was ingested without one")
    folder = build.paths.episodes
    folder.parent.mkdir(parents=True, exist_ok=True)
    ensure_dvc_repo(build.root)
    dvc_file = write_snapshot_file(folder, snapshot_hash)
    try:
        if lineage.snapshot_remote:
            pull_snapshot(build.root, dvc_file, _remote_of(source, lineage.snapshot_remote))
        else:
            checkout_from_cache(build.root, dvc_file, source.root)
    except DvcException as exc:
        where = lineage.snapshot_remote or f"the DVC cache of {source.root}"
        raise ReproduceError(f"snapshot {snapshot_hash} could not be restored from {where} (garbage-collected, or "
                             f"never pushed?): {str(exc).splitlines()[0]}") from exc
    return EpisodeDataset(folder, build.episodes)


def _remote_of(source: Settings, url: str) -> DvcRemote:
    """The remote at ``url``, with this root's endpoint when its configured remote is that one."""
    endpoint = source.episodes.dvc_remote_endpoint if source.episodes.dvc_remote == url else ""
    return DvcRemote(url, endpoint)


def kept_store(source: Settings, build: Settings, version: int, lineage: Lineage) -> SegmentStore:
    """``source``'s segment store (opened with the recipe's store settings) at the version
    v``version`` read, which registration tagged."""
    tag = STORE_TAG.format(version=version)
    location = Workspace(source).store_location
    if not table_exists(location, build.store.table):
        raise ReproduceError(f"no segment store at {location.table_uri(build.store.table)}; v{version} read store "
                             f"version {lineage.lancedb_version}")
    store = SegmentStore.open(location, build.store, Workspace(build).embedding_dim)
    if store.tags().get(tag) is None:
        raise ReproduceError(f"store version {lineage.lancedb_version} of v{version} is no longer kept (no tag {tag!r}: "
                             f"only the newest store.model_versions_kept train-task models' versions are; upkeep "
                             f"may have pruned it)")
    view = store.checkout(tag)
    if view.version != lineage.lancedb_version:
        raise ReproduceError(f"store tag {tag!r} points at version {view.version}, lineage says {lineage.lancedb_version}")
    return view
