"""Atomic checkpoints and a trainer that resumes exactly where it stopped."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from components.episodes.dataset import EpisodeDataset
from components.fleet.local import synthetic_episode
from components.fleet.trainer import FleetTrainer
from components.training.checkpoint import (
    TrainingCheckpoint,
    capture_rng,
    list_checkpoints,
    load_latest,
    restore_rng,
    save_checkpoint,
)
from tests.conftest import small_settings


def _checkpoint(step: int) -> TrainingCheckpoint:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return TrainingCheckpoint(step, model.state_dict(), optimizer.state_dict(), capture_rng(torch.Generator()), {"episodes": step})


def test_checkpoints_are_atomic_pruned_and_a_broken_newest_falls_back(tmp_path: Path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, _checkpoint(step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000020.pt", "step-000000030.pt"]
    (tmp_path / ".step-000000040.pt.999.tmp").write_bytes(b"half a checkpoint (killed mid-save)")
    assert load_latest(tmp_path).step == 30  # a temp file is never a checkpoint
    list_checkpoints(tmp_path)[-1].write_bytes(b"torn")  # not possible with os.replace, but be safe
    latest = load_latest(tmp_path)
    assert latest.step == 20 and latest.cursor == {"episodes": 20}
    save_checkpoint(tmp_path, _checkpoint(50), keep=2)
    assert not list(tmp_path.glob(".step-*.tmp"))


def test_rng_capture_and_restore_replays_the_same_draws():
    generator = torch.Generator().manual_seed(3)
    state = capture_rng(generator)
    first = (torch.randint(100, (5,), generator=generator), torch.rand(3), np.random.rand(2))
    restore_rng(state, generator)
    again = (torch.randint(100, (5,), generator=generator), torch.rand(3), np.random.rand(2))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, again))


def _settings(root: Path, runtime_dir: str):
    base = small_settings(root)
    runtime = base.runtime.model_copy(update={"runtime_dir": runtime_dir, "checkpoint_every": 10, "steps_per_episode": 2, "trainer_batch_size": 16})
    return base.model_copy(update={"runtime": runtime})


def test_trainer_killed_and_resumed_continues_the_exact_same_loss_curve(tmp_path: Path):
    dataset = EpisodeDataset(small_settings(tmp_path).paths.episodes, small_settings(tmp_path).episodes)
    dataset.add_episodes([synthetic_episode(f"robot-{i % 2:04d}", seed=i, length=10) for i in range(20)])

    straight = FleetTrainer(_settings(tmp_path, "run-a"))
    straight.consume()
    straight.train(40)

    crashed = FleetTrainer(_settings(tmp_path, "run-b"))
    crashed.consume()
    crashed.train(27)  # "killed" at step 27: steps 21..27 were never checkpointed
    resumed = FleetTrainer(_settings(tmp_path, "run-b"))
    assert resumed.resume() and resumed.state.step == 20 and resumed.state.resumes == [20]
    assert resumed.state.cursor == 20 and resumed.state.owed == straight.state.owed + 20
    resumed.consume()  # nothing new: the cursor says all 20 episodes are already in the buffer
    resumed.train(20)
    assert resumed.state.losses == straight.state.losses  # steps 1..40, bit for bit
    assert [s for s, _ in resumed.state.losses] == list(range(1, 41))


def test_trainer_run_loop_consumes_new_data_and_stops_on_request(tmp_path: Path):
    settings = _settings(tmp_path, "run-c")
    dataset = EpisodeDataset(settings.paths.episodes, settings.episodes)
    dataset.add_episodes([synthetic_episode("robot-0000", seed=100 + i, length=10) for i in range(6)])
    dataset.add_episodes([synthetic_episode("robot-0001", seed=200, length=10, success=False)])  # filtered out
    trainer = FleetTrainer(settings)
    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,))
    thread.start()
    for _ in range(200):
        if trainer.state.cursor == 7 and trainer.state.owed == 0:
            break
        stop.wait(0.05)
    stop.set()
    thread.join()
    assert trainer.state.cursor == 7 and trainer.state.frames == 60  # the failed episode is not trained on
    assert trainer.state.step == 7 * settings.runtime.steps_per_episode
