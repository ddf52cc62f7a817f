"""What the async trainer imitates: ``train.method``'s training set, rebuilt by one rule a resume can replay.

    bc / filtered_bc     from every episode consumed so far; rebuilt whenever new ones arrive
    fert / fert_uniform  from a *pin* (BuildPin): the first ``episodes`` dataset episodes, the segment
                         store at ``store_version`` (whose embed cursor says it holds exactly those)
                         and the champion whose failures query; a new pin once the store has embedded
                         ``runtime.trainer_rebuild_episodes`` more episodes than the last one
    both go through ``pipeline.steps.method_training_set``, the flow's train task's own builder.

The pin is kept in every checkpoint. A resumed trainer rebuilds from it — the store checked out at
the pinned version, the registry not asked again — so it trains on the same frames with the same
weights, whatever the fleet stored since. Pinned versions are tagged so store upkeep never prunes
one a kept checkpoint needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from components.config import Settings
from components.fert.methods import MethodTrainingSet
from components.store.location import StoreLocation, store_location
from components.store.segment_store import SegmentStore, table_exists

log = logging.getLogger(__name__)

TAG_PREFIX = "fleet-trainer-v"  # segment store tags of pinned versions


@dataclass(frozen=True)
class BuildPin:
    """What a training set was built from."""

    episodes: int  # the first N dataset episodes (dataset order)
    store_version: int = -1  # segment store version retrieval read (-1: the method reads no store)
    champion: int | None = None  # whose failures queried (fert.failures_from: champion)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: dict) -> BuildPin:
        return cls(int(body["episodes"]), int(body["store_version"]),
                   None if body.get("champion") is None else int(body["champion"]))


class StorePins:
    """For the retrieval methods: when a new pin is due, the store at a pin, and tags that keep it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._store: SegmentStore | None = None
        self.waiting = ""  # why no new pin could be taken (shown in the trainer's status)

    def live(self) -> SegmentStore | None:
        """The store, once the ingest has created it (the trainer never creates it)."""
        if self._store is None:
            if not table_exists(self._location, self.settings.store.table):
                return None
            from components.pipeline.workspace import Workspace

            self._store = Workspace(self.settings).store
        return self._store

    def next_pin(self, consumed_ids: Sequence[str], last: BuildPin | None) -> BuildPin | None:
        """A new pin when the store has embedded ``trainer_rebuild_episodes`` more of the consumed
        episodes than ``last`` (any, for the first); else None, with the reason in ``waiting``."""
        store = self.live()
        cursor = store.embed_cursor() if store is not None else None
        if cursor is None or cursor.episodes == 0:
            self.waiting = self._no_store_reason()
            return None
        due = last is None or cursor.episodes - last.episodes >= self.settings.runtime.trainer_rebuild_episodes
        if not due:
            self.waiting = ""
            return None
        assert store is not None
        view = store.checkout(store.version)  # one version: its cursor and its rows go together
        cursor = view.embed_cursor()
        assert cursor is not None
        if cursor.episodes > len(consumed_ids):  # the store is ahead of our last dataset read
            self.waiting = f"store embedded {cursor.episodes} episodes, trainer consumed {len(consumed_ids)}"
            return None
        if consumed_ids[cursor.episodes - 1] != cursor.last_episode_id:
            self.waiting = (f"the segment store's embed cursor names {cursor.last_episode_id!r}, not the dataset's episode "
                            f"{cursor.episodes - 1}; it was built from another dataset: re-embed ({self._location})")
            return None
        self.waiting = ""
        return BuildPin(cursor.episodes, view.version, self._champion())

    @property
    def _location(self) -> StoreLocation:
        """The store's folder or ``store.uri`` (an object store)."""
        return store_location(self.settings.paths.store, self.settings.store)

    def _champion(self) -> int | None:
        if self.settings.fert.failures_from != "champion":
            return None
        from components.pipeline.workspace import Workspace

        champion = Workspace(self.settings).registry.champion()
        return None if champion is None else champion.version

    def _no_store_reason(self) -> str:
        why = f"waiting for the segment store to embed episodes ({self._location})"
        if not self.settings.runtime.ingest_embeds:
            why += ("; runtime.ingest_embeds is false, so only `fleetloop ingest` embeds: set it true or "
                    "train.method=filtered_bc")
        return why

    def view(self, pin: BuildPin) -> SegmentStore:
        """The store as ``pin`` saw it (read-only)."""
        store = self.live()
        if store is None:
            raise RuntimeError(f"the trainer's checkpoint pins segment store version {pin.store_version}, but "
                               f"{self._location} holds no store; restore it or move the checkpoints aside")
        try:
            return store.checkout(pin.store_version)
        except Exception as exc:  # noqa: BLE001 - LanceDB raises ValueError or a Rust error for a missing version
            raise RuntimeError(
                f"the trainer's checkpoint pins segment store version {pin.store_version}, which "
                f"{self._location} no longer has ({exc}); move the trainer's checkpoints aside to start fresh"
            ) from exc

    def keep(self, pin: BuildPin, kept: int) -> None:
        """Tag ``pin``'s version; untag trainer pins older than the newest ``kept`` (checkpoints only
        ever pin one of those: pins only move forward and ``kept`` is checkpoints_kept + 1)."""
        store = self.live()
        assert store is not None
        tags = store.tags()
        name = f"{TAG_PREFIX}{pin.store_version}"
        if name not in tags:
            store.tag(name, pin.store_version)
        ours = sorted(v for t, v in tags.items() if t.startswith(TAG_PREFIX)) + [pin.store_version]
        for version in sorted(set(ours))[:-kept]:
            store.untag(f"{TAG_PREFIX}{version}")


def describe(built: MethodTrainingSet, pin: BuildPin, step: int) -> dict:
    """The status record of a build."""
    r = built.report
    return {"method": r.method, "pin": pin.to_dict(), "built_at_step": step, "frames": len(built.data.states),
            "failed_episodes": r.failed_episodes, "queries": r.queries, "matches": r.matches,
            "seconds": round(r.seconds, 3)}
