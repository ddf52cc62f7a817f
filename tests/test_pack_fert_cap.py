"""benchmarks/pack_fert_cap.py: the study's FERT cell is kept, and every variant retrains on the data
that cell stored, scored on the same tuning robots and trials."""

from __future__ import annotations

from dataclasses import replace

from benchmarks import fleet_scaling as fs
from benchmarks import pack_fert_cap as cap


def test_variants_retrain_on_the_kept_cells_data(tmp_path, monkeypatch):
    monkeypatch.setattr(cap, "CEILING_DEMO_ROBOTS", 2)
    plan = replace(fs.QUICK["pack"], rounds=1, fleet_sizes=(2,), steps_per_robot=60, finetune_steps=10,
                   heldout_robots=2, trials_per_robot=1, validation_robots=2, validation_trials=1,
                   methods=("fert",), robots="tuning")
    grid = cap.Grid(seeds=1, steps=8, robots=3, trials=2, plan=plan)
    cell = cap.run_seed(0, grid, str(tmp_path))

    assert fs.cell_root(tmp_path, 0, "fert", 2).is_dir()  # kept for the retrains
    variants = cell["variants"]
    assert list(variants) == list(cap.VARIANTS)
    for name, v in variants.items():
        assert v["trials"] == grid.robots * grid.trials, name
    fleet_frames = variants["filtered_bc_scratch"]["frames"]
    assert variants["fert_scratch"]["frames"] == variants["fert_more"]["frames"] == fleet_frames
    assert fleet_frames > variants["demos_scratch"]["frames"] > 0  # the fleet round's successes are in
    assert set(variants["champion"]["successes_by_robot"]) == {"tuning-0000", "tuning-0001", "tuning-0002"}
    table = cap.summarize([cell])
    assert table["champion"]["minus_champion_points"]["mean"] == 0.0
