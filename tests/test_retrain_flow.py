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
    assert (tmp_path / "datasets" / "episodes.dvc").exists()

    collected, second = fleet_round(settings, 1)
    assert collected.episodes > 0
    assert second.candidate.version == champion.version + 1
    # champion moves only through the gate; either way one version holds the alias
    assert ws.registry.champion().version in (champion.version, second.candidate.version)
    assert Workspace(settings).dataset.num_episodes == demos.episodes + collected.episodes
