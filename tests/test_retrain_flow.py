"""The first closed loop on real Prefect, MLflow (SQLite), LanceDB and DVC, in a scratch root."""

import pytest

from components.pipeline.workspace import Workspace
from flows.fleet_round import bootstrap, fleet_round
from tests.conftest import small_settings


@pytest.mark.slow
def test_bootstrap_then_fleet_round_registers_champion(tmp_path, prefect_harness):
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

    collected, second = fleet_round(1, None, settings)
    assert collected.episodes > 0
    assert second.candidate.version == champion.version + 1
    assert second.champion_eval is not None  # the champion was re-evaluated on the same trials
    assert second.champion_eval["trials"] == second.candidate.trials
    # champion moves only through the gate; either way one version holds the alias
    assert Workspace(settings).registry.champion().version in (champion.version, second.candidate.version)
    assert Workspace(settings).dataset.num_episodes == demos.episodes + collected.episodes
