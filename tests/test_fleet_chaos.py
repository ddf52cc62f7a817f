"""Chaos (CI size): SIGKILL robots, inference, ingest, the trainer and the coordinator mid-run; the
dataset audited against every robot's ledger: nothing lost, nothing doubled, nothing corrupted."""

from __future__ import annotations

import json

from components.config import SimConfig
from components.fleet.chaos import LOSS_WINDOW, ChaosPlan, chaos_settings, run_chaos
from tests.conftest import small_settings

# A robot first (robots finish fastest; a kill with no robot left running would be skipped), then the
# trainer while data is still arriving: killed after it has caught up, it would have nothing left to resume.
# 30 episodes per robot: on a quiet machine 10 were all stored ~4 s after the first upload, so the
# trainer had caught up with everything before its kill and had nothing left to continue with.
# The coordinator's SIGKILL takes every member down with it (they watch it); the runner then starts
# a new coordinator, as `fleet up` would, and the fleet carries on from the robots' spools.
PLAN = ChaosPlan(
    robots=4, episodes_per_robot=30, kills=("robot", "trainer", "inference", "coordinator", "robot", "ingest"),
    min_gap_s=1.0, max_gap_s=2.5, seed=7, timeout_s=480.0,  # bounded; generous for a loaded CI machine
)


def test_fleet_survives_sigkills_with_every_episode_stored_exactly_once(tmp_path):
    # no motion exploration: the loss check below compares the trainer's loss after a resume with its
    # first steps, and exploring robots' later episodes carry noisier labels than the first ones
    base = small_settings(tmp_path, sim=SimConfig(max_steps=40, motion_noise_std=0.0))
    report = run_chaos(chaos_settings(base, PLAN), PLAN)
    (tmp_path / "chaos_report.json").write_text(report.to_json())
    print(json.dumps({k: getattr(report, k) for k in ("finished", "stored", "duplicated", "lost", "corrupted", "seconds")}))

    assert report.completed, report.to_json()
    assert report.leaked_pids == [] and report.outlived_coordinator == 0
    killed = {f.target.split("-")[0] for f in report.faults}
    assert {"inference", "ingest", "trainer", "robot", "coordinator"} <= killed, report.faults
    # every episode a robot finished is stored exactly once, uncorrupted
    assert report.finished == PLAN.robots * PLAN.episodes_per_robot
    assert report.stored == report.finished
    assert (report.duplicated, report.lost, report.corrupted) == (0, 0, 0)
    # every killed process came back
    assert all(report.restarts.get(f.target, 0) >= 1 for f in report.faults)
    # the trainer resumed from a checkpoint and its loss curve went on from there
    assert report.trainer_resumes and report.loss_steps_contiguous
    assert report.trainer_steps > report.trainer_resumes[-1]
    # continued, not restarted: a resumed model's loss is below a fresh model's first steps. Only
    # judged where the checkpoint is well past the start: resumed at the first checkpoint, the model
    # has barely learned and the data that arrived meanwhile can lift the loss either way (the exact
    # bit-for-bit resume is tests/test_fleet_checkpoint.py's job)
    learned = [a for a in report.loss_around_resumes if a["resume_step"] >= 3 * LOSS_WINDOW]
    for around in learned:
        assert around["after_mean"] < around["first_steps_mean"], around
