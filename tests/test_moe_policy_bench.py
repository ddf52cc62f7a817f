"""benchmarks/moe_policy.py: the seed-level summary and the headline speed-up it reports."""

from __future__ import annotations

import pytest

from benchmarks import moe_policy as mp
from benchmarks.fleet_scaling import Score


def _score(successes: int, trials: int = 10) -> Score:
    return Score(successes, trials, successes, {})


def test_success_summary_pairs_seeds_and_pools_trials() -> None:
    scores = {"mlp": {"bootstrap": [_score(8), _score(6)], "fleet_32": [_score(7), _score(7)]},
              "moe": {"bootstrap": [_score(9), _score(6)], "fleet_32": [_score(9), _score(8)]}}
    out = mp.summarize_success(scores, 0.95)
    assert out["mlp"]["bootstrap"]["per_seed"] == [0.8, 0.6] and out["mlp"]["bootstrap"]["pooled"]["trials"] == 20
    assert out["moe"]["fleet_32"]["pooled"]["rate"] == pytest.approx(0.85)
    diff = out["moe_minus_mlp"]["fleet_32"]
    assert diff["per_seed"] == pytest.approx([0.2, 0.1]) and diff["mean"] == pytest.approx(0.15)
    assert diff["low"] < diff["mean"] < diff["high"] and diff["seeds"] == 2
    one_seed = mp.summarize_success({k: {"bootstrap": v["bootstrap"][:1]} for k, v in scores.items()}, 0.95)
    assert one_seed["moe_minus_mlp"]["bootstrap"]["low"] is None  # one seed has no spread: no interval


def test_headline_speedup_is_at_the_largest_experts_on_the_most_processes() -> None:
    cells = [{"experts": 8, "top_k": 2, "world": 1, "variants": {}},
             {"experts": 8, "top_k": 2, "world": 2, "speedup_fused_vs_megatron": 3.0},
             {"experts": 64, "top_k": 1, "world": 4, "speedup_fused_vs_megatron": 1.1},
             {"experts": 64, "top_k": 2, "world": 4, "speedup_fused_vs_megatron": 1.3},
             {"experts": 64, "top_k": 8, "world": 4, "speedup_fused_vs_megatron": 1.5},
             {"experts": 16, "top_k": 2, "world": 4, "speedup_fused_vs_megatron": 9.0}]
    head = mp.headline_speedup(cells)
    assert (head["experts"], head["world"], head["value"]) == (64, 4, pytest.approx(1.3))
    assert mp.headline_speedup(cells[:1]) == {"value": None}


def test_success_study_reports_kept_seeds_without_running_them(tmp_path) -> None:
    """--cells: a seed whose scores are kept is not run again, and its scores come back as they
    were written (a stopped study resumes where it stopped)."""
    import json
    from dataclasses import asdict, replace

    from benchmarks.fleet_scaling import QUICK

    kept = {"mlp": {"bootstrap": _score(7), "fleet_4": _score(8)}, "moe": {"bootstrap": _score(6), "fleet_4": _score(9)}}
    for seed in range(2):
        (tmp_path / f"seed-{seed}.json").write_text(json.dumps(
            {kind: {phase: asdict(s) for phase, s in phases.items()} for kind, phases in kept.items()}))
    plan = replace(QUICK["pickplace"], seeds=2, fleet_sizes=(4,))
    scores, seeds = mp.success_study(None, plan, workers=2, cells=tmp_path)  # settings unused: nothing left to run
    assert seeds == [0, 1] and scores["moe"]["fleet_4"] == [kept["moe"]["fleet_4"]] * 2
    assert [s.rate for s in scores["mlp"]["bootstrap"]] == [0.7, 0.7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed-0.json", "seed-1.json"]
    # a study stopped before its last seed: --finished-only reports the seeds that finished
    (tmp_path / "seed-0.json").unlink()
    scores, seeds = mp.success_study(None, replace(plan, seeds=3), cells=tmp_path, finished_only=True)
    assert seeds == [1] and len(scores["mlp"]["fleet_4"]) == 1
