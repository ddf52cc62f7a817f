"""The ingest service's store half: what the group-commit writer stored is embedded into the
segment store by the same function the ingest flow runs (``pipeline.ingest.embed_pending``).

    commit stored episodes --notify()--> embedder thread --embed_pending--> segment store
                                          (also every runtime.embed_interval_s)

Uploads never wait for it: an episode is acknowledged once it is in the dataset. Embedding
resumes from the store's embed cursor, so a killed service (or a failed embed) loses nothing: the
next pass picks up every stored episode past the cursor. Failures retry with a doubling delay
capped at ``runtime.embed_backoff_max_s``; the health probe reports a dead thread.
"""

from __future__ import annotations

import logging
import threading

from components.config import Settings
from components.episodes.dataset import EpisodeDataset
from components.pipeline.ingest import embed_pending

log = logging.getLogger("fleetloop.fleet.embedder")


class StoreEmbedder:
    """One background thread running ``embed_pending`` after commits and on an interval."""

    def __init__(self, settings: Settings, dataset: EpisodeDataset) -> None:
        self.settings = settings
        self.dataset = dataset  # the ingest service's own handle (its writer commits through it)
        self.cfg = settings.runtime
        self.segments = 0  # written since start
        self.passes = 0
        self.failures = 0  # in a row
        self.last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-embedder", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """New episodes were stored: embed them soon."""
        self._wake.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def status(self) -> dict:
        return {"segments": self.segments, "passes": self.passes, "failures_in_a_row": self.failures,
                "last_error": self.last_error}

    def _delay(self) -> float:
        if not self.failures:
            return self.cfg.embed_interval_s
        return min(self.cfg.embed_interval_s * 2 ** (self.failures - 1), self.cfg.embed_backoff_max_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._delay())
            self._wake.clear()
            if self._stop.is_set():
                return
            self._pass()

    def _pass(self) -> None:
        if not self._has_episodes():
            return
        try:
            written = embed_pending(self.settings)
        except Exception as exc:  # noqa: BLE001 - stored episodes stay past the cursor: the next pass retries
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("embedding stored episodes failed (%s); retrying in %.1f s", self.last_error, self._delay())
            return
        self.passes += 1
        self.failures, self.last_error = 0, None
        self.segments += written
        if written:
            log.info("embedded %d segments into the store", written)

    def _has_episodes(self) -> bool:
        return self.dataset.num_episodes > 0
