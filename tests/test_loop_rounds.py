"""components/pipeline/loop.py's rounds with the plain steps (what a study runs): a round without the fleet."""

from components.pipeline import loop
from components.pipeline.workspace import Workspace
from tests.conftest import small_settings


def test_a_stored_data_round_retrains_on_the_store_alone_through_the_gate(tmp_path):
    settings = small_settings(tmp_path)
    steps = loop.plain_fleet_steps(loop.plain_retrain_steps(snapshot=False))
    rounds = list(loop.campaign(settings, 2, lambda s: loop.bootstrap(s, steps),
                                lambda s, r: loop.stored_data_round(s, r, steps, "init")))
    assert [r for r, _, _ in rounds] == [0, 1, 2]
    demos, first = rounds[0][1:]
    assert first.ingested is not None and len(first.ingested.report.added) == demos.episodes
    registry = Workspace(settings).registry
    for r, collected, done in rounds[1:]:
        assert collected is None and done.ingested is None  # nothing collected, nothing ingested
        assert done.outcome.result.steps > 0  # but trained, registered and gated
        assert done.promotion.candidate.version == first.promotion.candidate.version + r
        assert done.promotion.champion_eval is not None  # judged against the champion
        assert registry.load(done.promotion.candidate.version).state_dict().keys()
        assert done.promotion.candidate.lineage.episodes == demos.episodes  # the demos and nothing else
    assert Workspace(settings).dataset.num_episodes == demos.episodes
