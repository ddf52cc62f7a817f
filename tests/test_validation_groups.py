"""Validation groups (``train.validation_groups``): the trainer's validation robots split into
fixed rollouts, so a plan may run them side by side on separate processes (Rose's replicate
rewrite) and every plan still validates, and trains, bit for bit the same."""

from __future__ import annotations

import pytest

from components.config import SchedulerConfig
from components.scheduler.rose import candidate_transformations, legality, replicate_rollout


@pytest.fixture(scope="module")
def grouped_trainer():
    from components.config import PolicyConfig, SimConfig
    from components.episodes.record import camera_key
    from components.fert.corpus import EpisodeList
    from components.fert.priority import FrameTable
    from components.sim.collect import run_episodes
    from components.sim.factory import make_expert
    from components.training.trainer import Trainer
    from components.training.workflow import TrainSpec, ValidationSpec

    sim = SimConfig(cameras=("scene", "gripper"), max_steps=40)
    sim = sim.model_copy(update={"camera": sim.camera.model_copy(update={"width": 16, "height": 16})})
    episodes = run_episodes(make_expert(sim), ["robot-0000", "robot-0001"], sim, 2, seed=0, policy_version="expert")
    data = FrameTable.from_corpus(EpisodeList(episodes), "expert",
                                  cameras=(camera_key("gripper"), camera_key("scene"))).training_set()
    policy = PolicyConfig(kind="vision", hidden=32, layers=2, vision_channels=4, vision_feature=8, augment_shift=2)
    robots = ("validation-0000", "validation-0001", "validation-0002")
    spec = TrainSpec(data=data, policy=policy, lr=1e-3, weight_decay=1e-4, batch_size=8, seed=3, total_steps=6,
                     steps_per_iteration=2, validation=ValidationSpec(sim, robots, 2, seed=5, groups=2))
    return Trainer(spec, SchedulerConfig())


def test_groups_are_contiguous_shares_fixed_by_their_count():
    from components.config import SimConfig
    from components.training.workflow import ValidationSpec

    spec = ValidationSpec(SimConfig(), ("a", "b", "c", "d", "e"), 1, seed=0, groups=2)
    assert [spec.group_robots(g) for g in range(2)] == [["a", "b", "c"], ["d", "e"]]
    with pytest.raises(ValueError, match="train.validation_groups=3 must be between 1 and train.validation_robots=2"):
        ValidationSpec(SimConfig(), ("a", "b"), 1, seed=0, groups=3)


def test_replicated_validators_train_and_validate_as_sequential_does(grouped_trainer):
    from components.training.checkpoint import state_digest
    from components.training.trainer import PlanChoice

    trainer = grouped_trainer
    wf = trainer.runtime.workflow_at(2)
    assert wf.component("validator").replicable and wf.loops == {"group": 2}
    base = trainer.runtime.sequential()
    assert "replicate_rollout" in {t.name for t in candidate_transformations(wf, base)}
    replicated = replicate_rollout(wf, base, 2)
    assert replicated is not None and not legality(wf, replicated, range(3))
    # the natural coarse form: one validator process that rolls out both groups
    coarse = trainer.runtime.coarse_processes()
    assert [w.groups for w in coarse.workers if "validator" in w.components] == [None]

    ref = trainer.run(trainer.choose("sequential"))
    assert len(ref.validation) == 3 and all(0.0 <= v <= 1.0 for v in ref.validation)
    for plan in (replicated, coarse):
        got = trainer.run(PlanChoice(plan, plan.name, "fixed"))
        assert state_digest(got.policy.state_dict()) == state_digest(ref.policy.state_dict()), plan.name
        assert got.losses == ref.losses and got.validation == ref.validation, plan.name
    validators = {s.worker for s in got.timeline.spans if s.op == "validate"}
    assert len(validators) == 1  # coarse: one process
    got = trainer.run(PlanChoice(replicated, "replicated", "fixed"))
    assert len({s.worker for s in got.timeline.spans if s.op == "validate"}) == 2
