"""A vision policy (``policy.kind: vision``) in the one trainer: seeded augmentation, the packed
observation every caller passes, bit-identical weights under every plan (validation rollouts that
render included), the camera ``Dict`` at execution, the registry round trip, and the train step on a
dataset that stores its camera streams as video."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from components.config import PolicyConfig, SchedulerConfig, SimConfig
from components.episodes.record import camera_key
from components.policy.actor import PolicyActor
from components.policy.factory import make_policy
from components.policy.observation import CameraShape, ObservationLayout, configured_layout
from components.sim.collect import run_episodes
from components.sim.factory import action_dim, make_expert, make_thresholded, observation_dim
from components.training.augment import augment_and_pack, shift_images
from components.training.checkpoint import state_digest
from components.training.imitation import TrainingSet
from components.training.trainer import Trainer
from components.training.workflow import TrainSpec, ValidationSpec
from tests.conftest import small_settings

SIZE = 16
VISION = PolicyConfig(kind="vision", hidden=32, layers=2, vision_channels=4, vision_feature=8, augment_shift=2)
CAMERA_SIM = SimConfig(cameras=("scene", "gripper"))
CAMERA_SIM = CAMERA_SIM.model_copy(update={"camera": CAMERA_SIM.camera.model_copy(update={"width": SIZE, "height": SIZE})})
KEYS = (camera_key("gripper"), camera_key("scene"))
STATE, ACTION = observation_dim(CAMERA_SIM), action_dim(CAMERA_SIM)


def _camera_demos(robots: int = 2, episodes: int = 2):
    return run_episodes(make_expert(CAMERA_SIM), [f"robot-{i:04d}" for i in range(robots)], CAMERA_SIM, episodes,
                        seed=0, policy_version="expert")


def _training_set(episodes) -> TrainingSet:
    from components.fert.corpus import EpisodeList
    from components.fert.priority import FrameTable

    return FrameTable.from_corpus(EpisodeList(episodes), "expert", cameras=KEYS).training_set()


def _spec(policy: PolicyConfig, data: TrainingSet, validate: bool = False) -> TrainSpec:
    validation = ValidationSpec(CAMERA_SIM, ("validation-0000",), 1, seed=5) if validate else None
    return TrainSpec(data=data, policy=policy, lr=1e-3, weight_decay=1e-4, batch_size=8, seed=3, total_steps=6,
                     steps_per_iteration=2, validation=validation)


def test_augmentation_is_seeded_shifts_whole_images_and_zero_packs_unchanged() -> None:
    rng = np.random.default_rng(0)
    frames = torch.from_numpy(rng.integers(0, 256, size=(3, 4, SIZE, SIZE, 3), dtype=np.uint8))
    states = torch.randn(3, 4, 5)
    layout = ObservationLayout(5, (CameraShape("cam", SIZE, SIZE),))
    a = augment_and_pack(states, {"cam": frames}, layout, 3, seed=1, iteration=7)
    b = augment_and_pack(states, {"cam": frames}, layout, 3, seed=1, iteration=7)
    assert torch.equal(a, b) and a.shape == (3, 4, 5 + SIZE * SIZE * 3) and a.dtype == torch.float32
    assert not torch.equal(a, augment_and_pack(states, {"cam": frames}, layout, 3, seed=1, iteration=8))
    assert torch.equal(a[..., :5], states)
    plain = augment_and_pack(states, {"cam": frames}, layout, 0, seed=1, iteration=7)
    assert torch.equal(plain[..., 5:], frames.reshape(3, 4, -1).float())

    one = torch.from_numpy(rng.integers(0, 256, size=(1, SIZE, SIZE, 3), dtype=np.uint8))
    shifted = shift_images(one, 2, torch.Generator().manual_seed(0))
    # a shift moves the image: some (dy, dx) in [-2, 2] maps the interior onto the original's interior
    matches = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
               if torch.equal(shifted[0, 2:-2, 2:-2], one[0, 2 + dy: SIZE - 2 + dy, 2 + dx: SIZE - 2 + dx])]
    assert len(matches) == 1


def test_the_packed_observation_round_trips_and_a_wrong_camera_says_how_to_fix_it() -> None:
    layout = ObservationLayout(3, (CameraShape("a", 4, 6), CameraShape("b", 2, 2)))
    state = np.arange(6, dtype=np.float32).reshape(2, 3)
    images = {"a": np.full((2, 4, 6, 3), 7, np.uint8), "b": np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3)}
    packed = layout.pack(state, images)
    assert packed.shape == (2, layout.dim) == (2, 3 + 72 + 12)
    back_state, back_images = layout.unpack(torch.from_numpy(packed))
    assert torch.equal(back_state, torch.from_numpy(state))
    assert torch.equal(back_images[1].permute(0, 2, 3, 1).to(torch.uint8), torch.from_numpy(images["b"]))
    with pytest.raises(KeyError, match="set sim.cameras"):
        layout.pack(state, {"a": images["a"]})
    with pytest.raises(ValueError, match="sim.camera.height / width"):
        layout.pack(state, {"a": images["a"][:, :2], "b": images["b"]})
    with pytest.raises(ValueError, match="FLEETLOOP_SIM__CAMERAS"):
        VISION.camera_views(())
    assert configured_layout(11, VISION, CAMERA_SIM).keys == KEYS
    assert configured_layout(11, PolicyConfig(), CAMERA_SIM).cameras == ()


@pytest.mark.parametrize("policy", [VISION, VISION.model_copy(update={"vision_chunk": 3, "vision_state": False})],
                         ids=["one-action", "chunk-no-state"])
def test_vision_policy_trains_bit_identically_under_every_plan(policy) -> None:
    from components.scheduler.plan import Plan, WorkerSpec
    from components.training.trainer import PlanChoice

    data = _training_set(_camera_demos())
    trainer = Trainer(_spec(policy, data, validate=policy.vision_chunk == 1), SchedulerConfig())
    ref = trainer.run(trainer.choose("sequential"))
    assert len(ref.losses) == 6 and all(np.isfinite(ref.losses)) and ref.losses[-1] != ref.losses[0]
    side = (WorkerSpec("side", ("validator",)),) if policy.vision_chunk == 1 else ()
    hoisted = Plan("hoist", (WorkerSpec("io", ("sampler", "augmenter")), WorkerSpec("main", ("learner",)), *side),
                   threads={"learner": 1, "sampler": 1, "augmenter": 1, "validator": 1}, blas_threads=1,
                   hoist=frozenset({"sample", "augment"}))
    for choice in (PlanChoice(hoisted, "hoist", "fixed"),
                   PlanChoice(trainer.runtime.coarse_processes(), "coarse-processes", "fixed")):
        got = trainer.run(choice)
        assert state_digest(got.policy.state_dict()) == state_digest(ref.policy.state_dict()), choice.name
        assert got.losses == ref.losses and got.validation == ref.validation
    if policy.vision_chunk == 1:  # the rollouts rendered the validation robot's cameras
        assert len(ref.validation) == 3 and all(0.0 <= v <= 1.0 for v in ref.validation)
    out = ref.policy(torch.zeros(2, ref.policy.obs_dim))
    assert out.shape == ((2, ACTION) if policy.vision_chunk == 1 else (2, 3, ACTION))


def test_the_actor_packs_the_simulators_camera_dict_and_a_sim_without_cameras_is_refused() -> None:
    torch.manual_seed(0)
    policy = make_policy(STATE, ACTION, VISION, configured_layout(STATE, VISION, CAMERA_SIM))
    actor = PolicyActor(policy)
    assert actor.sees_cameras and policy.sees_cameras and policy.state_dim == STATE
    episodes = run_episodes(make_thresholded(CAMERA_SIM, actor), ["robot-0000", "robot-0001"], CAMERA_SIM, 1,
                            seed=0, policy_version="v1")
    assert len(episodes) == 2 and all(set(ep.cameras) == set(KEYS) for ep in episodes)
    state_only = CAMERA_SIM.model_copy(update={"cameras": ()})
    with pytest.raises(ValueError, match="simulator renders none: set sim.cameras"):
        run_episodes(make_thresholded(state_only, PolicyActor(policy)), ["robot-0000"], state_only, 1, 0, "v1")


def test_a_vision_policy_round_trips_through_the_registry(tmp_path) -> None:
    from components.registry.lineage import Lineage
    from components.registry.model_registry import PolicyRegistry

    settings = small_settings(tmp_path)
    torch.manual_seed(0)
    policy = make_policy(STATE, ACTION, VISION, configured_layout(STATE, VISION, CAMERA_SIM))
    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    evaluation = {"success_rate": 0.5, "ci_low": 0.1, "ci_high": 0.9, "successes": 1, "trials": 2}
    lineage = Lineage("abc", "def", 1, "p", episodes=2, frames=30)
    version = registry.log_candidate(policy, evaluation, lineage, {}, {}, [], "vision")
    loaded = registry.load(version.version)
    obs = torch.from_numpy(configured_layout(STATE, VISION, CAMERA_SIM).pack(
        np.ones((2, STATE), np.float32), {k: np.full((2, SIZE, SIZE, 3), 200, np.uint8) for k in KEYS}))
    with torch.no_grad():
        assert torch.equal(loaded(obs), policy(obs))
    assert loaded.layout == policy.layout and loaded.sees_cameras


def test_the_train_step_learns_from_stored_camera_video(tmp_path) -> None:
    """Episodes stored with their camera streams (AV1 video features) -> the training set decodes
    them -> a vision policy trains; the same again gives the same weights."""
    from components.pipeline import steps
    from components.pipeline.workspace import Workspace

    settings = small_settings(tmp_path, sim=CAMERA_SIM, policy=VISION)
    settings = settings.model_copy(update={"train": settings.train.model_copy(update={"epochs": 1})})
    Workspace(settings).dataset.add_episodes(_camera_demos())
    first = steps.train_policy(settings)
    built = steps.training_set(settings, Workspace(settings))
    assert built.data.images is not None and set(built.data.images) == set(KEYS)
    assert built.data.images[KEYS[0]].shape == (len(built.data.states), SIZE, SIZE, 3)
    assert first.result.policy.sees_cameras and first.result.policy.layout.keys == KEYS
    again = steps.train_policy(settings)
    assert state_digest(again.result.policy.state_dict()) == state_digest(first.result.policy.state_dict())
