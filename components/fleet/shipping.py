"""Shipping: the async trainer's checkpoints become candidates, judged like every other model.

    due?     ``candidate_every_steps`` optimizer steps, or ``candidate_every_s`` seconds, since the
             last candidate (whichever first), and the step is one this trainer run never shipped
    -> the trainer checkpoints that step: the candidate *is* that checkpoint's weights
    -> evaluate_policy on held-out robots (the seeded trials every path uses)
    -> the champion on the same trials (kept per version: evaluation is deterministic)
    -> register_candidate: MLflow run + registered version, lineage (current_lineage; ``episodes``
       = the trainer's data cursor) + the trainer's run id and step as tags + the champion's
       evaluation (the failure explorer's "before")
    -> gate_candidate: ``registry.rollout: direct`` moves @champion when the gate says better;
       ``canary`` starts a CanaryRollout, which the coordinator judges on live outcomes
    -> the inference service's AliasWatcher hot-swaps whatever alias moved
While a canary rolls out, shipping waits (``candidate_retry_s``): one rollout at a time.

Never twice: the ship is recorded in the checkpoint rewritten at the same step and in
``state/trainer.json``; a trainer killed between registering and that rewrite resumes from an
older checkpoint, so before its first ship it asks MLflow which steps its run already shipped
(the tags go on the run before the version is registered).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from components.config import Settings
from components.evaluation.heldout import EvaluationReport
from components.fert.retrieval_record import RetrievalRecord
from components.policy.normalizer import NormalizedPolicy
from components.training.imitation import TrainResult

log = logging.getLogger(__name__)

RUN_TAG = "fleetloop.trainer.run"  # the trainer run (a fresh start draws one; resumes keep it)
STEP_TAG = "fleetloop.trainer.step"  # the optimizer step (= checkpoint) the candidate is
SOURCE_TAG = "fleetloop.source"
SOURCE = "fleet-trainer"


@dataclass(frozen=True)
class ShippedCandidate:
    """One checkpoint turned candidate: what the registry and the gate made of it."""

    step: int
    version: int | None  # None: found already shipped by this run (registry), nothing registered
    time: float  # wall clock, when registered
    promoted: bool  # the gate passed (champion moved, or a canary started)
    canary: int | None  # the version rolling out as canary, if the rollout is canary
    champion_after: int | None
    gate: str  # the gate's reason
    seconds: float  # checkpoint -> registered candidate (evaluation + MLflow)
    gate_seconds: float  # registered -> gated (champion evaluation, aliases)

    @classmethod
    def from_dict(cls, body: dict) -> ShippedCandidate:
        return cls(**{f.name: body.get(f.name) for f in dataclasses.fields(cls)})


@dataclass
class ShippingState:
    """What the trainer checkpoints about shipping (``extra["shipping"]``) and reports."""

    run_id: str
    since: float  # wall clock the time trigger counts from (start, or the last candidate)
    last: ShippedCandidate | None = None
    shipped: int = 0  # candidates registered by this trainer run
    promoted: int = 0
    waiting: str = ""  # why a due candidate is not shipped yet (a live canary, a failure)
    retry_at: float = 0.0  # wall clock; no attempt before it
    history: list[dict] = field(default_factory=list)  # the newest candidates, as dicts

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "last": dataclasses.asdict(self.last) if self.last else None}

    @classmethod
    def from_dict(cls, body: dict) -> ShippingState:
        last = body.get("last")
        fields = {k: body[k] for k in ("run_id", "since", "shipped", "promoted", "waiting", "retry_at", "history") if k in body}
        return cls(**fields, last=ShippedCandidate.from_dict(last) if last else None)

    @property
    def last_step(self) -> int:
        return self.last.step if self.last is not None else 0


HISTORY_KEPT = 20


class CandidateShipper:
    """Decides when a checkpoint is due and ships it through the product's own steps."""

    def __init__(self, settings: Settings, state: ShippingState) -> None:
        self.settings = settings
        self.cfg = settings.runtime
        self.state = state
        self._workspace = None
        self._champion_evals: dict[int, EvaluationReport] = {}  # same trials, same weights: same report
        self._registered_steps: set[int] | None = None  # this run's steps MLflow already holds

    # ------------------------------------------------------------------ when
    @property
    def enabled(self) -> bool:
        return self.cfg.candidate_every_steps > 0 or self.cfg.candidate_every_s > 0

    def due(self, step: int, now: float) -> bool:
        """A new step, and enough steps or seconds since the last candidate."""
        s, cfg = self.state, self.cfg
        if not self.enabled or step <= s.last_step or now < s.retry_at:
            return False
        by_steps = cfg.candidate_every_steps > 0 and step - s.last_step >= cfg.candidate_every_steps
        by_time = cfg.candidate_every_s > 0 and now - s.since >= cfg.candidate_every_s
        return by_steps or by_time

    def defer(self, reason: str, now: float) -> None:
        self.state.waiting = reason
        self.state.retry_at = now + self.cfg.candidate_retry_s

    # ------------------------------------------------------------------ how
    @property
    def workspace(self):
        if self._workspace is None:  # MLflow and LanceDB load on the first ship, not at trainer start
            from components.pipeline.workspace import Workspace

            self._workspace = Workspace(self.settings)
        return self._workspace

    def blocked_by(self) -> str | None:
        """Why a candidate may not roll out now (a live canary), or None."""
        if self.settings.registry.rollout != "canary":
            return None
        canary = self.workspace.registry.aliases().get(self.cfg.canary_alias)
        return None if canary is None else f"canary v{canary} is rolling out"

    def already_shipped(self, step: int) -> bool:
        """True when MLflow holds a candidate run of this trainer run at ``step`` (a kill between
        registering it and the checkpoint that records it)."""
        if self._registered_steps is None:
            registry = self.workspace.registry
            runs = registry.client.search_runs(
                [registry.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{self.state.run_id}'", max_results=10_000
            )
            self._registered_steps = {int(r.data.tags[STEP_TAG]) for r in runs if STEP_TAG in r.data.tags}
        return step in self._registered_steps

    def champion_eval(self) -> EvaluationReport | None:
        from components.pipeline.evaluate import evaluate_policy

        registry = self.workspace.registry
        champion = registry.champion()
        if champion is None:
            return None
        if champion.version not in self._champion_evals:
            policy = registry.load(champion.version)
            self._champion_evals[champion.version] = evaluate_policy(self.settings, policy, f"v{champion.version}")
        return self._champion_evals[champion.version]

    def ship(self, policy: NormalizedPolicy, step: int, cursor: int, frames: int, losses: list[float],
             robots: Counter[str], method: str, started: float, store_version: int | None = None,
             retrieval: RetrievalRecord | None = None) -> ShippedCandidate:
        """Evaluate, register (with lineage), gate and roll out ``policy`` (a copy: it is not trained
        further) as the candidate of ``step``; ``started`` is when its checkpoint was written. FERT
        builds pass the segment store version their retrieval read and what it retrieved."""
        from components.pipeline.evaluate import evaluate_policy
        from components.pipeline.promote import gate_candidate, register_candidate
        from components.pipeline.steps import TrainOutcome, current_lineage

        s = self.state
        now = time.time()
        if self.already_shipped(step):
            log.warning("step %d of trainer run %s is already registered; not shipping it again", step, s.run_id)
            return self._record(ShippedCandidate(step, None, now, False, None, None, "already shipped by this run", 0.0, 0.0))
        policy.eval()
        report = evaluate_policy(self.settings, policy, f"trainer-{step}")
        lineage = current_lineage(self.settings, self.workspace, frames)
        lineage = dataclasses.replace(lineage, episodes=cursor, episodes_per_robot=dict(sorted(robots.items())))
        if store_version is not None:
            lineage = dataclasses.replace(lineage, lancedb_version=store_version)
        result = TrainResult(policy=policy, losses=losses, steps=step, seconds=0.0, device="cpu")
        tags = {RUN_TAG: s.run_id, STEP_TAG: str(step), SOURCE_TAG: SOURCE,
                "fleetloop.method": method}
        champion_eval = self.champion_eval()  # kept on the run too: the failure explorer's "before"
        candidate = register_candidate(self.settings, TrainOutcome(result, lineage, frames, retrieval=retrieval), report,
                                       f"fleet-trainer-step-{step}", tags=tags, champion_evaluation=champion_eval)
        assert self._registered_steps is not None
        self._registered_steps.add(step)
        registered = time.time()
        promotion = gate_candidate(self.settings, candidate, champion_eval)
        if promotion.decision.promote and promotion.champion_after == candidate.version:
            self._champion_evals = {candidate.version: report}  # the new champion: same trials, this report
        shipped = ShippedCandidate(
            step, candidate.version, registered, promotion.decision.promote, promotion.canary, promotion.champion_after,
            promotion.decision.reason, registered - started, time.time() - registered,
        )
        log.info("step %d -> v%d (%.1fs to register, %.1fs to gate): %s", step, candidate.version, shipped.seconds,
                 shipped.gate_seconds, promotion.decision.reason)
        return self._record(shipped)

    def _record(self, shipped: ShippedCandidate) -> ShippedCandidate:
        s = self.state
        s.last, s.since, s.waiting, s.retry_at = shipped, shipped.time, "", 0.0
        if shipped.version is not None:
            s.shipped += 1
            s.promoted += int(shipped.promoted)
        s.history = [*s.history[-HISTORY_KEPT + 1 :], dataclasses.asdict(shipped)]
        return shipped
