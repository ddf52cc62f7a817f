"""benchmarks/vision_train.py's main path at a tiny size (16x16 cameras, batch 16, one round of
one measured iteration): it runs every row (auto, the baselines, the DataLoader loop) and writes
the JSON keys and the plot. Timings are not asserted: only that they are there."""

from __future__ import annotations

import json
import math


def test_vision_train_benchmark_runs_and_writes_its_keys(tmp_path) -> None:
    from benchmarks import vision_train

    summary = vision_train.main(["--tiny", "--out", str(tmp_path), "--name", "vt"])
    written = json.loads((tmp_path / "vt.json").read_text())
    assert (tmp_path / "vt.png").stat().st_size > 0
    for key in ("plans", "best_baseline", "auto_over_best_baseline", "stage_split", "span_bound", "capacity",
                "target_met", "commit", "machine", "auto_plan"):
        assert key in written, key
    plans = written["plans"]
    assert set(plans) == {"auto", "sequential", "default-threads", "coarse-processes", "dataloader(workers=1)"}
    for row in plans.values():
        assert row["frames_per_s"] > 0 and row["median_iteration_s"] > 0 and isinstance(row["bit_identical"], bool)
    # every scheduler plan trains the sequential weights and validates them the same way; the
    # library-default learner threads may round differently
    assert plans["auto"]["bit_identical"] and plans["coarse-processes"]["bit_identical"]
    assert plans["auto"]["validated_iterations"] == plans["sequential"]["validated_iterations"] > 0
    assert written["best_baseline"] in plans and written["best_baseline"] != "auto"
    ratio = written["auto_over_best_baseline"]
    assert math.isfinite(ratio["median"]) and len(ratio["interval"]) == 2
    assert {"sample", "augment", "learn", "validate"} <= set(written["stage_split"]["sequential"])
    assert {"load", "learn", "validate"} <= set(written["stage_split"]["dataloader(workers=1)"])
    assert written["span_bound"]["span_ms"] > 0 and written["workload"]["camera"] == "16x16"
    assert summary["best_baseline"] == written["best_baseline"]
