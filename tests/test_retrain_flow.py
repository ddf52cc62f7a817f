"""The first closed loop on real Prefect, MLflow (SQLite), LanceDB and DVC, in a scratch root."""

import pytest

from components.pipeline.workspace import Workspace
from flows.fleet_round import bootstrap, fleet_round
from tests.conftest import small_settings


@pytest.mark.slow
def test_bootstrap_then_fleet_round_registers_champion(tmp_path, tmp_path_factory, prefect_harness):
    settings = small_settings(tmp_path)
    demos, promotion = bootstrap(settings)
    assert demos.episodes == settings.demo.expert_robots * settings.demo.expert_episodes_per_robot
    assert promotion.decision.promote  # the first model becomes champion
    ws = Workspace(settings)
    champion = ws.registry.champion()
    assert champion is not None and champion.version == promotion.candidate.version
    lineage = champion.lineage
    assert lineage.snapshot_hash.endswith(".dir")  # a DVC directory hash
    assert lineage.lancedb_version >= 1
    assert lineage.episodes == demos.episodes
    assert sum(lineage.episodes_per_robot.values()) == demos.episodes
    assert (tmp_path / "datasets" / "episodes.dvc").exists()
    assert ws.store.episode_ids() == {ep.episode_id for ep in ws.dataset.episodes()}

    from cli.reports import lineage_report, status_report

    report = lineage_report(settings, "champion")  # what `fleetloop lineage champion` prints
    assert report["model"] == f"fleetloop-policy v{champion.version}" and "champion" in report["aliases"]
    assert report["dvc_snapshot"] == lineage.snapshot_hash and report["lancedb_version"] == lineage.lancedb_version
    assert report["mlflow_run"]["id"] == champion.run_id and report["git_commit"]
    assert report["episodes_per_robot"] == ws.dataset.robots()
    assert status_report(settings, 5)["champion"]["version"] == champion.version

    collected, second = fleet_round(1, None, settings)
    assert collected.episodes > 0
    assert second.candidate.version == champion.version + 1
    assert second.champion_eval is not None  # the champion was re-evaluated on the same trials
    assert second.champion_eval["trials"] == second.candidate.trials
    # champion moves only through the gate; either way one version holds the alias
    assert Workspace(settings).registry.champion().version in (champion.version, second.candidate.version)
    assert Workspace(settings).dataset.num_episodes == demos.episodes + collected.episodes
    _the_plain_loop_gives_the_same_models(settings, tmp_path_factory.mktemp("plain-loop"), [promotion, second])


def _the_plain_loop_gives_the_same_models(flowed, root, promotions) -> None:
    """What a study runs (components/pipeline/loop.py with the plain steps, in this process) is what
    the flows run: the same demos and rounds, bit-identical registered weights, the same candidate
    evaluations and gate decisions, in a root of its own."""
    from components.pipeline import loop
    from components.training.checkpoint import state_digest

    settings = flowed.model_copy(update={"root": root})
    steps = loop.plain_fleet_steps(loop.plain_retrain_steps())
    _, first = loop.bootstrap(settings, steps)
    _, second = loop.fleet_round(settings, 1, None, steps)
    for plain, flow_outcome in zip((first, second), promotions, strict=True):
        assert plain.promotion.candidate.version == flow_outcome.candidate.version
        assert (plain.report.overall.successes, plain.report.overall.trials) == (
            flow_outcome.candidate.successes, flow_outcome.candidate.trials)
        assert plain.promotion.decision.promote == flow_outcome.decision.promote
        assert plain.promotion.champion_eval == flow_outcome.champion_eval
        version = flow_outcome.candidate.version
        assert state_digest(Workspace(settings).registry.load(version).state_dict()) == state_digest(
            Workspace(flowed).registry.load(version).state_dict())
    assert Workspace(settings).dataset.num_episodes == Workspace(flowed).dataset.num_episodes


@pytest.mark.slow
def test_train_flow_launches_expert_parallel_for_world_size_2(tmp_path, prefect_harness):
    """train.world_size > 1: the Prefect train task runs torchrun (2 gloo ranks) on the MoE policy."""
    from components.config import PolicyConfig, TrainConfig
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.evaluate import evaluate_policy
    from components.pipeline.ingest import ingest_files
    from components.policy.moe import MoETransformerPolicy
    from components.pipeline.references import load_candidate
    from flows.train import train

    settings = small_settings(
        tmp_path,
        policy=PolicyConfig(kind="moe_transformer", d_model=16, heads=2, hidden=16, layers=1, num_experts=4, top_k=2, history=4),
        train=TrainConfig(method="filtered_bc", epochs=1, batch_size=32, world_size=2),
    )
    demos = collect_expert_demos(settings, settings.paths.incoming / "expert")
    ingest_files(settings, demos.files)
    outcome = load_candidate(train(settings))  # the flow returns a reference to the staged candidate
    assert isinstance(outcome.result.policy.core, MoETransformerPolicy)
    assert outcome.result.steps == len(outcome.result.losses) > 0
    assert all(loss == loss for loss in outcome.result.losses)  # finite, no NaN
    report = evaluate_policy(settings, outcome.result.policy, "moe")
    assert report.overall.trials == settings.fleet.num_heldout_robots * settings.evaluation.trials_for(settings.fleet.num_heldout_robots)


def test_expert_parallel_starts_from_a_champion_of_the_same_architecture(tmp_path):
    """The champion seeds expert-parallel fine-tuning; an MLP champion cannot seed an MoE policy."""
    import torch

    from components.config import PolicyConfig, TrainConfig
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.distributed import champion_init_state
    from components.pipeline.evaluate import evaluate_policy
    from components.pipeline.ingest import ingest_files
    from components.pipeline.promote import gate_candidate, register_candidate

    moe = PolicyConfig(kind="moe_transformer", d_model=16, heads=2, hidden=16, layers=1, num_experts=4, top_k=2, history=4)
    settings = small_settings(tmp_path, policy=moe, train=TrainConfig(method="filtered_bc", epochs=1, batch_size=32))
    assert champion_init_state(Workspace(settings), settings) is None  # no champion yet: from scratch
    demos = collect_expert_demos(settings, tmp_path / "incoming")
    ingest_files(settings, demos.files, snapshot=False)
    outcome = steps.train_policy(settings)
    report = evaluate_policy(settings, outcome.result.policy, "candidate")
    candidate = register_candidate(settings, outcome, report, "bootstrap")
    client = Workspace(settings).registry.client  # expert utilisation on the run: per-step series + plot
    shares = client.get_metric_history(candidate.run_id, "moe_expert_share.e0")
    dropped = client.get_metric_history(candidate.run_id, "moe_dropped_rate")
    steps = outcome.result.steps
    assert len(shares) == len(dropped) == len(range(0, steps, max(1, steps // 500))) > 0
    assert all(0 <= m.value <= 1 for m in dropped)
    artifacts = {a.path for a in client.list_artifacts(candidate.run_id)}
    assert {"expert_usage.png", "training.json"} <= artifacts
    gate_candidate(settings, candidate, None)
    state = champion_init_state(Workspace(settings), settings)
    expected = outcome.result.policy.state_dict()
    assert state is not None and all(torch.equal(state[k], expected[k]) for k in expected)
    mlp_settings = settings.model_copy(update={"policy": PolicyConfig()})
    assert champion_init_state(Workspace(mlp_settings), mlp_settings) is None  # other architecture: from scratch


def test_train_cache_key_reads_the_scheduler_and_shuffle_sections_only_when_training_uses_them(tmp_path):
    from types import SimpleNamespace

    from flows.train import train_task

    key = train_task.cache_key_fn
    context = SimpleNamespace(task=train_task)

    def key_of(settings):
        return key(context, {"settings": settings, "snapshot_hash": "abc", "champion_version": 1})

    base = small_settings(tmp_path)
    other_scheduler = {"scheduler": base.scheduler.model_copy(update={"iterations": base.scheduler.iterations + 1})}
    other_shuffle = {"shuffle": base.shuffle.model_copy(update={"chunks": base.shuffle.chunks + 1})}
    imitation = base.model_copy(update={"train": base.train.model_copy(update={"workload": "imitation", "world_size": 1})})
    assert key_of(imitation) == key_of(imitation.model_copy(update=other_scheduler))  # the cached model is reused
    assert key_of(imitation) == key_of(imitation.model_copy(update=other_shuffle))
    assert key_of(imitation) != key_of(imitation.model_copy(update={"train": imitation.train.model_copy(update={"lr": 0.5})}))

    ppo = base.model_copy(update={"train": base.train.model_copy(update={"workload": "ppo"})})
    assert key_of(ppo) != key_of(ppo.model_copy(update=other_scheduler))  # the plan's knobs are the ppo run's inputs
    parallel = base.model_copy(update={"train": base.train.model_copy(update={"world_size": 2})})
    assert key_of(parallel) != key_of(parallel.model_copy(update=other_shuffle))
