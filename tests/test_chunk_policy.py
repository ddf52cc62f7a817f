"""ACT-style action chunks: chunk targets that stop at the episode's end, per-chunk priority weights,
temporal ensembling at execution (PolicyActor and the robot agent), and the same registry and
inference service as every other policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from components.config import PolicyConfig, SchedulerConfig
from components.policy.actor import PolicyActor
from components.policy.ensemble import ChunkEnsemble
from components.policy.factory import make_policy
from components.policy.history import as_tensor_episode_ends, episode_last_rows, frame_positions, gather_chunks
from components.training.checkpoint import state_digest
from components.training.imitation import TrainingSet
from components.training.trainer import Trainer
from components.training.workflow import Sampler, TrainSpec, op_sample
from tests.conftest import small_settings

CHUNK = PolicyConfig(kind="chunk_transformer", d_model=16, heads=2, hidden=16, layers=1, history=2, chunk_size=4)
MOE_CHUNK = CHUNK.model_copy(update={"chunk_ffn": "moe", "num_experts": 4, "top_k": 2, "capacity_factor": 1.0})
LENGTHS = [5, 2, 9]


def _spec(policy: PolicyConfig, weights: np.ndarray | None = None, steps: int = 9) -> TrainSpec:
    rng = np.random.default_rng(0)
    states = rng.normal(size=(sum(LENGTHS), 5)).astype(np.float32)
    actions = np.arange(sum(LENGTHS) * 2, dtype=np.float32).reshape(-1, 2)  # row r's action: [2r, 2r + 1]
    data = TrainingSet(states, actions, weights, frame_positions(LENGTHS))
    return TrainSpec(data=data, policy=policy, lr=1e-3, weight_decay=1e-4, batch_size=8, seed=3, total_steps=steps,
                     steps_per_iteration=2)


def test_config_keeps_the_default_kind_and_refuses_a_replan_past_the_chunk() -> None:
    assert PolicyConfig().kind == "mlp" and PolicyConfig().actions() == 1
    assert CHUNK.frames() == 2 and CHUNK.actions() == 4
    with pytest.raises(ValidationError, match="policy.replan_every=5 must be <= policy.chunk_size=4"):
        PolicyConfig(kind="chunk_transformer", chunk_size=4, replan_every=5)


def test_chunk_targets_stop_at_the_episode_end_never_the_next_episode() -> None:
    actions = torch.arange(sum(LENGTHS), dtype=torch.float32).unsqueeze(1)  # row r's action: r
    ends = as_tensor_episode_ends(frame_positions(LENGTHS))
    np.testing.assert_array_equal(episode_last_rows(frame_positions(LENGTHS)), [4] * 5 + [6] * 2 + [15] * 9)
    targets, real = gather_chunks(actions, ends, torch.arange(sum(LENGTHS)), 4)
    assert targets.shape == (16, 4, 1) and real.shape == (16, 4)
    assert targets[0, :, 0].tolist() == [0, 1, 2, 3] and real[0].all()
    assert targets[3, :, 0].tolist() == [3, 4, 4, 4] and real[3].tolist() == [True, True, False, False]
    assert targets[5, :, 0].tolist() == [5, 6, 6, 6] and real[5].tolist() == [True, True, False, False]
    assert targets[6, :, 0].tolist() == [6, 6, 6, 6] and real[6].tolist() == [True, False, False, False]
    assert targets[14, :, 0].tolist() == [14, 15, 15, 15]
    episode_of = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    assert (episode_of[targets[..., 0].long().numpy()] == episode_of[:, None]).all()  # never another episode
    one, mask = gather_chunks(actions, ends, torch.tensor([3, 7]), 1)
    assert mask is None and one[:, 0].tolist() == [3, 7]  # chunk 1: the frame's own action, as before


def test_a_chunk_carries_its_starting_frames_priority_weight() -> None:
    """Only rows with weight start a chunk (FERT's priority per chunk); a zero-weight row still
    serves as a later target of a chunk that starts before it in its episode."""
    weights = np.zeros(sum(LENGTHS))
    weights[[1, 10]] = [1.0, 3.0]
    sampler = Sampler(_spec(CHUNK, weights))
    inputs, targets, mask = op_sample(sampler, {"iteration": 0}, {})["batch"]
    assert inputs.shape == (2, 8, 2, 5) and targets.shape == (2, 8, 4, 2) and mask.shape == (2, 8, 4)
    starts = (targets[..., 0, 0] / 2).long()
    assert set(starts.flatten().tolist()) <= {1, 10}
    assert targets[starts == 1][0, :, 0].tolist() == [2, 4, 6, 8]  # rows 1..4 of episode 0 (weight 0 after row 1)
    assert mask[starts == 10].all()


def test_masked_targets_add_nothing_to_the_loss() -> None:
    from components.training.bc import bc_step, make_optimizer

    torch.manual_seed(0)
    policy = make_policy(5, 2, CHUNK)
    states = torch.randn(3, 2, 5)
    targets = torch.randn(3, 4, 2)
    mask = torch.tensor([[True, True, False, False]] * 3)
    changed = targets.clone()
    changed[:, 2:] += 100.0  # what lies past the episode's end
    losses = []
    for t in (targets, changed):
        torch.manual_seed(1)
        p = make_policy(5, 2, CHUNK)
        p.load_state_dict(policy.state_dict())
        losses.append(bc_step(p, make_optimizer(p, 1e-3, 0.0), states, t, mask=mask))
        assert state_digest(p.state_dict()) != state_digest(policy.state_dict())  # it did take a step
    assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="chunk policy"):
        bc_step(policy, make_optimizer(policy, 1e-3, 0.0), states, targets[:, 0])


@pytest.mark.parametrize("policy", [CHUNK, MOE_CHUNK], ids=["dense", "moe"])
def test_chunk_policy_trains_bit_identically_under_every_plan(policy) -> None:
    from components.scheduler.plan import Plan, WorkerSpec
    from components.training.trainer import PlanChoice

    trainer = Trainer(_spec(policy, np.linspace(0.5, 2.0, sum(LENGTHS))), SchedulerConfig())
    ref = trainer.run(trainer.choose("sequential"))
    assert len(ref.losses) == 9 and all(np.isfinite(ref.losses))
    hoisted = Plan("hoist", (WorkerSpec("io", ("sampler",)), WorkerSpec("main", ("learner",))),
                   threads={"learner": 1, "sampler": 1}, blas_threads=1, hoist=frozenset({"sample"}))
    got = trainer.run(PlanChoice(hoisted, "hoist", "fixed"))
    assert state_digest(got.policy.state_dict()) == state_digest(ref.policy.state_dict()) and got.losses == ref.losses
    coarse = trainer.runtime.coarse_processes()
    got = trainer.run(PlanChoice(coarse, "coarse-processes", "fixed"))
    assert state_digest(got.policy.state_dict()) == state_digest(ref.policy.state_dict()) and got.losses == ref.losses
    assert ref.policy(torch.zeros(1, 5)).shape == (1, 4, 2)


def test_temporal_ensembling_weights_the_oldest_prediction_most() -> None:
    """ACT: a_t = sum_i w_i chunk_i[t - s_i] / sum_i w_i, w_i = exp(-m i), i = 0 the oldest."""
    m = 0.5
    ens = ChunkEnsemble(chunk=3, replan_every=1, decay=m)
    chunks = [np.full((1, 3, 1), 10.0 * (q + 1)) + np.arange(3)[None, :, None] for q in range(4)]  # query q: 10(q+1) + j
    got = []
    for q in range(4):
        assert ens.due(1)[0]
        ens.add(chunks[q], np.ones(1, dtype=bool))
        got.append(float(ens.act()[0, 0]))
    w = np.exp(-m * np.arange(3))
    assert got[0] == pytest.approx(10.0)
    assert got[1] == pytest.approx((w[0] * 11 + w[1] * 20) / w[:2].sum())
    assert got[2] == pytest.approx((w[0] * 12 + w[1] * 21 + w[2] * 30) / w.sum())
    assert got[3] == pytest.approx((w[0] * 22 + w[1] * 31 + w[2] * 40) / w.sum())  # query 0's chunk has run out
    ens.restart(np.array([True]))
    assert ens.due(1)[0]
    with pytest.raises(RuntimeError, match="no chunk covering"):
        ens.act()


def test_open_loop_chunks_run_as_predicted_and_replan_on_schedule() -> None:
    ens = ChunkEnsemble(chunk=4, replan_every=4, decay=0.01)
    queried, actions = [], []
    for t in range(9):
        due = ens.due(2)
        if due.any():
            queried.append(t)
            ens.add(np.stack([np.arange(4) + 100 * t + 1000 * e for e in np.flatnonzero(due)])[:, :, None], due)
        actions.append(ens.act()[:, 0])
    assert queried == [0, 4, 8]
    assert [a[0] for a in actions] == [0, 1, 2, 3, 400, 401, 402, 403, 800]
    assert [a[1] for a in actions] == [1000, 1001, 1002, 1003, 1400, 1401, 1402, 1403, 1800]


def test_policy_actor_queries_due_envs_and_restarts_at_episode_ends() -> None:
    torch.manual_seed(0)
    policy = make_policy(5, 2, CHUNK.model_copy(update={"replan_every": 2}))
    obs = np.random.default_rng(0).normal(size=(6, 3, 5)).astype(np.float32)  # (steps, envs, n)
    with torch.no_grad():
        chunk0 = policy.eval()(torch.as_tensor(obs[0])).numpy()
    calls: list[int] = []
    policy.core.register_forward_pre_hook(lambda _m, args: calls.append(len(args[0])))
    actor = PolicyActor(policy)
    out = [actor(obs[0]), actor(obs[1])]
    assert calls == [3]  # step 1 executes step 0's chunks
    np.testing.assert_allclose(out[0], chunk0[:, 0], atol=1e-6)
    np.testing.assert_allclose(out[1], chunk0[:, 1], atol=1e-6)
    actor.end_episodes(np.array([False, True, False]))
    actor(obs[2])
    actor.end_episodes(np.array([True, False, False]))
    actor(obs[3])
    assert calls == [3, 3, 1]  # step 2: every env due; step 3: env 0 started a new episode, the others mid-chunk
    open_loop = PolicyActor(policy, execution=CHUNK.model_copy(update={"replan_every": 4}))
    assert open_loop.ensemble is not None and open_loop.ensemble.replan_every == 4


def test_registry_pyfunc_and_inference_service_serve_the_chunk(tmp_path) -> None:
    """The registry logs a chunk policy (signature: one observation -> one chunk); its pyfunc model,
    the loaded torch model and the running inference service answer the same chunk; a robot agent
    asks the service only every ``policy.replan_every`` steps."""
    import mlflow.pyfunc

    from components.fleet.auth import issue_tokens
    from components.fleet.clients import InferenceClient
    from components.fleet.layout import RuntimeLayout
    from components.fleet.local import register_policy, running_service, service_url, with_free_ports
    from components.fleet.robot_agent import RemotePolicy
    from components.registry.model_registry import PolicyRegistry

    settings = with_free_ports(small_settings(tmp_path), alias_poll_s=0.2, batch_window_ms=5.0)
    settings = settings.model_copy(update={"policy": CHUNK.model_copy(update={"replan_every": 3})})
    torch.manual_seed(0)
    policy = make_policy(11, 3, settings.policy).eval()
    registry = PolicyRegistry(settings.paths.mlruns, settings.registry)
    version = register_policy(settings, policy)
    registry.set_champion(version)
    obs = np.random.default_rng(1).normal(size=(1, 11)).astype(np.float32)
    with torch.no_grad():
        expected = policy(torch.as_tensor(obs)).numpy()
    assert expected.shape == (1, 4, 3)
    np.testing.assert_allclose(mlflow.pyfunc.load_model(f"models:/{settings.registry.model_name}/{version}").predict(obs),
                               expected, atol=1e-6)
    loaded = registry.load(version)
    assert loaded.chunk == 4 and loaded.chunk_execution == (3, CHUNK.ensemble_decay)

    layout = RuntimeLayout.of(settings).ensure()
    tokens = issue_tokens(layout.token_file, ["robot-0000"])
    with running_service(settings, "inference"):
        client = InferenceClient(service_url(settings, "inference"), tokens.robots["robot-0000"], 30.0)
        try:
            answer = client.act(obs[0])
            assert answer.chunk is not None and answer.chunk.shape == (4, 3)
            np.testing.assert_allclose(answer.chunk, expected[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(answer.action, answer.chunk[0])
            remote = RemotePolicy(client, settings)
            stream = np.random.default_rng(2).normal(size=(7, 1, 11)).astype(np.float32)
            for frame in stream:
                assert remote(frame).shape == (1, 3)
            assert len(remote.versions) == 3  # steps 0, 3, 6
        finally:
            client.close()


def test_train_step_expert_parallel_entry_and_fleet_trainer_train_the_same_chunk_weights(tmp_path) -> None:
    """The MoE chunk variant through the train step, the expert-parallel entry (one process, every
    expert local) and the FATS fleet trainer: same demos + params = the same weights, bit for bit."""
    from components.config import TrainConfig
    from components.fleet.trainer import FleetTrainer
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.ingest import ingest_files
    from components.pipeline.workspace import Workspace
    from components.training.bc import total_steps
    from components.training.expert_parallel import train_expert_parallel

    base = small_settings(tmp_path)
    settings = base.model_copy(update={"policy": MOE_CHUNK, "train": base.train.model_copy(update={
        "method": "filtered_bc", "epochs": 1, "batch_size": 64, "steps_per_iteration": 7, "validation_robots": 0})})
    ingest_files(settings, collect_expert_demos(settings, settings.root / "demos").files, snapshot=False)
    outcome = steps.train_policy(settings)
    digest = state_digest(outcome.result.policy.state_dict())
    built = steps.training_set(settings, Workspace(settings))
    arrays = {"states": built.data.states, "actions": built.data.actions, "frame_in_episode": built.data.frame_in_episode}
    if built.data.weights is not None:
        arrays["weights"] = built.data.weights.astype(np.float64)
    np.savez(tmp_path / "set.npz", **arrays)
    ep = train_expert_parallel(tmp_path / "set.npz", tmp_path / "ep.pt", MOE_CHUNK,
                               TrainConfig(**{**settings.train.model_dump(), "threads": 0}), settings.shuffle,
                               seed=settings.seed)
    assert ep.losses == outcome.result.losses and state_digest(torch.load(ep.state_dict_path)) == digest
    fleet = settings.model_copy(update={"runtime": settings.runtime.model_copy(update={
        "trainer_batch_size": settings.train.batch_size, "checkpoint_every": 10_000})})
    trainer = FleetTrainer(fleet)
    assert trainer.consume() == Workspace(settings).dataset.num_episodes
    trainer.train(total_steps(outcome.frames, settings.train.batch_size, settings.train.epochs))
    assert state_digest(trainer.policy.state_dict()) == digest
