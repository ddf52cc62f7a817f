"""Chaos (CI size of benchmarks/fleet_chaos.py, the same function): a running fleet has every kind
of member SIGKILLed (the coordinator too), its connections dropped, delayed and reset, its disk
filled and its writes failed, a robot's token revoked and re-issued; the dataset is then audited
against every robot's ledger: nothing lost, nothing doubled, nothing corrupted."""

from __future__ import annotations

import json

import pytest

from benchmarks.fleet_chaos import (
    BenchmarkSize,
    benchmark_settings,
    run_benchmark,
    write_results,
)
from components.fleet.chaos import FAULT_KINDS, KILLS
from components.fleet.chaos_audit import LOSS_WINDOW
from components.fleet.coordinator import backoff_delays

# one round of every kind (12 faults at 1-2.5 s gaps: ~22 s) plus 8-s windows. A longer phase starts
# a second round, whose coordinator kill restarts every member once more (~40 s of CI, nothing new)
SIZE = BenchmarkSize(robots=4, minutes=0.25, seed=7, quick=True)


@pytest.mark.slow
def test_fleet_under_every_fault_kind_stores_every_episode_exactly_once(tmp_path):
    report = run_benchmark(tmp_path / "root", SIZE)
    write_results(report, SIZE, tmp_path)  # the benchmark's JSON + PNG, as CI artifacts would be
    print(json.dumps({k: getattr(report, k) for k in ("finished", "stored", "duplicated", "lost", "corrupted", "faults_by_kind", "seconds")}))

    assert report.completed, report.to_json()
    assert report.leaked_pids == [] and report.outlived_coordinator == 0, report.outlived
    assert set(report.faults_by_kind) == set(FAULT_KINDS) and report.skipped == [], report.faults
    assert report.faults_by_kind["coordinator"] >= 1
    # every episode a robot finished is stored exactly once, uncorrupted
    assert report.finished > 0 and report.stored == report.finished
    assert (report.duplicated, report.lost, report.corrupted) == (0, 0, 0)
    # every killed process came back
    assert all(report.restarts.get(f.target, 0) >= 1 for f in report.faults if f.kind in KILLS), report.restarts
    # every robot connection went through the fault proxies, and they really cut some
    assert all(p["connections"] >= 1 for p in report.proxy.values())
    assert sum(p["dropped"] for p in report.proxy.values()) >= 1 and sum(p["reset"] for p in report.proxy.values()) >= 1
    # a robot revoked while running is restarted with doubling delays, never reset meanwhile (no storm)
    cfg = benchmark_settings(tmp_path / "root", SIZE).runtime
    for revoked in report.revocations:
        if revoked.failures:
            expected = backoff_delays(revoked.failures, cfg.restart_backoff_s, cfg.restart_backoff_max_s)
            assert revoked.delays == expected[-len(revoked.delays):], revoked
    # the trainer trained FERT (the default) from a pinned store version, resumed from a checkpoint
    # and its loss curve went on from there
    assert report.trainer_method == "fert" and report.trainer_pin["store_version"] >= 0, report.trainer_pin
    assert report.trainer_resumes and report.loss_steps_contiguous
    assert any(a["after_mean"] is not None for a in report.loss_around_resumes), report.loss_around_resumes
    # continued, not restarted: a resumed model's loss is below a fresh model's first steps. Only
    # judged where the checkpoint is well past the start (the exact bit-for-bit resume is
    # tests/test_fleet_checkpoint.py's job)
    learned = [a for a in report.loss_around_resumes if a["resume_step"] >= 3 * LOSS_WINDOW and a["after_mean"] is not None]
    for around in learned:
        assert around["after_mean"] < around["first_steps_mean"], around
