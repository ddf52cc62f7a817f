"""benchmarks/fleet_scaling.py: the fine-tuning budget rule and a tiny end-to-end run of the study."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import fleet_scaling as fs
from components.config import load_settings
from components.sim.profile import RobotProfile


def test_finetune_budget_is_about_the_steps_but_at_most_max_epochs_passes():
    settings = load_settings()  # batch_size 256
    assert fs.finetune_config(settings, 256 * 10, 600).epochs == 60  # 10 steps per pass
    assert fs.finetune_config(settings, 256 * 10, 600, max_epochs=6).epochs == 6
    assert fs.finetune_config(settings, 256 * 200, 600, max_epochs=6).epochs == 3  # the cap does not bind
    assert fs.finetune_config(settings, 10, 600).epochs == 600  # fewer frames than a batch: one step a pass


def _small(root=None) -> "fs.Settings":
    """params.yaml with a short bootstrap: few demos, few epochs (the study's grid is what is tested);
    ``root`` holds the MLflow store the cells' final policies go to."""
    s = load_settings()
    return s.model_copy(update={
        **({"root": root} if root is not None else {}),
        "demo": s.demo.model_copy(update={"expert_robots": 2, "expert_episodes_per_robot": 6}),
        "train": s.train.model_copy(update={"epochs": 3, "batch_size": 64, "steps_per_iteration": 10}),
        "fert": s.fert.model_copy(update={"calibration_episodes": 20}),
    })


def _tiny_plan(tmp_path: Path) -> fs.Plan:
    return replace(fs.QUICK["pickplace"], rounds=1, fleet_sizes=(1, 2), steps_per_robot=60, finetune_steps=20,
                   heldout_robots=2, trials_per_robot=2, validation_robots=2, validation_trials=2, init_rounds=1,
                   explain_dir=str(tmp_path / "explain"))


def _seeds_plan() -> fs.Plan:
    return replace(fs.QUICK["pickplace"], seeds=2, rounds=1, fleet_sizes=(2,), steps_per_robot=60, finetune_steps=10,
                   heldout_robots=2, trials_per_robot=2, validation_robots=2, validation_trials=2, methods=("fert",))


@dataclass
class Studies:
    """The module's three runs of the study (benchmarks/fleet_scaling.py ``run``) and where they went."""

    results: Path  # fs.RESULTS while they ran: <name>.json and .png
    tiny_root: Path  # the tiny study's root (its MLflow store) and explain/
    tiny_plan: fs.Plan
    tiny: dict  # one seed, two fleet sizes, every method, explained and logged to MLflow
    seeds_plan: fs.Plan
    alone: dict  # two seeds, one after the other in this process, each kept in alone_cells as it finished
    alone_cells: Path
    pooled: dict  # the same two seeds in two worker processes


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> Studies:
    """run() pins torch to one thread, so a study in this process leaves the second core idle: the
    pooled study's two worker processes run meanwhile (from a thread of this process, which only
    waits for them). The figures (plot) are drawn one at a time: pyplot is not thread-safe; the
    tiny study (whose failure explorer draws too) starts once the pooled one is done."""
    out = tmp_path_factory.mktemp("fleet-scaling")
    tiny_root, seeds_root = out / "tiny-root", out / "seeds-root"
    plot_lock = threading.Lock()
    draw = fs.plot

    def plot_alone(result: dict, path: Path) -> None:
        with plot_lock:
            draw(result, path)

    threads = torch.get_num_threads()
    seeds_plan, tiny_plan = _seeds_plan(), _tiny_plan(tiny_root)
    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(1) as pool:
        patch.setattr(fs, "RESULTS", out)
        patch.setattr(fs, "plot", plot_alone)
        try:
            pooled = pool.submit(fs.run, seeds_plan, "pooled", workers=2, settings=_small(seeds_root / "pooled"),
                                 log_models=False)
            alone = fs.run(seeds_plan, "alone", settings=_small(seeds_root / "alone"), log_models=False,
                           cells=out / "alone-cells")
            pooled_result = pooled.result()
            tiny = fs.run(tiny_plan, "tiny", settings=_small(tiny_root))
        finally:
            torch.set_num_threads(threads)  # run() pins torch to 1 thread, as the benchmark does
    return Studies(out, tiny_root, tiny_plan, tiny, seeds_plan, alone, out / "alone-cells", pooled_result)


@pytest.mark.slow
def test_tiny_study_writes_consistent_results(studies):
    tmp_path, plan, result = studies.tiny_root, studies.tiny_plan, studies.tiny
    saved = json.loads((studies.results / "tiny.json").read_text())
    assert saved["plan"]["fleet_sizes"] == [1, 2] and (studies.results / "tiny.png").exists()
    explained = sorted(p.relative_to(tmp_path / "explain").parent for p in (tmp_path / "explain").glob("*/*/index.json"))
    assert explained == [Path("cell-0-fert-1/round-1"), Path("cell-0-fert-2/round-1")]  # the fert cells' rounds only
    assert saved["settings"]["sim"]["motion_noise_std"] == pytest.approx(load_settings().sim.motion_noise_std)
    assert set(result["results"]) == {"bc", "filtered_bc", "fert"}
    for method, by_fleet in result["results"].items():
        for fleet, cell in by_fleet.items():
            t = cell["thresholded"]
            assert t["trials"] == plan.heldout_robots * plan.trials_per_robot, (method, fleet)
            # every failed held-out trial is counted once in the stage breakdown
            assert sum(cell["failures_by_stage"].values()) == t["trials"] - t["successes"], (method, fleet)
            assert t["ci_low"] <= t["rate"] <= t["ci_high"]
    targets = result["targets"]  # pick-place's criteria (fs.TARGETS), each with its figure
    assert targets["criteria"]["fert_at_largest"] == fs.TARGETS["pickplace"].fert_at_largest
    assert targets["fert_largest_fleet_meets"] == (targets["fert_largest_fleet_rate"] >= 0.97)
    fert2, fbc2 = (result["results"][m]["2"]["thresholded"]["rate"] for m in ("fert", "filtered_bc"))
    if fbc2 < 1:
        assert targets["residual_failures_removed"] == pytest.approx((fert2 - fbc2) / (1 - fbc2))
    assert targets["fert_minus_filtered_bc_seed_level_above_0"] is False and targets["gap_meets"] is False  # one seed
    assert list(targets["fert_step_means_points"]) == ["2"] and targets["fert_grows_with_fleet"] is None
    gap, low, high = result["targets"]["fert_minus_filtered_bc_ci_points"]
    assert gap == pytest.approx(result["targets"]["fert_minus_filtered_bc_points"]) and low <= gap <= high
    assert list(result["targets"]["fert_growth_steps_ci_points"]) == ["1->2"]
    # seed level: per fleet size, FERT − filtered BC (one seed: no t-interval, the bootstrap over robots still runs)
    gap = result["by_fleet"]["2"]["seed_level"]["fert_minus_filtered_bc"]
    assert set(gap) >= {"mean", "ci95", "bootstrap_ci95", "seeds_needed"} and gap["ci95"] is None
    assert gap["bootstrap_ci95"][0] <= gap["bootstrap_ci95"][1]
    assert gap["mean"] == pytest.approx(100 * (result["results"]["fert"]["2"]["thresholded"]["rate"]
                                               - result["results"]["filtered_bc"]["2"]["thresholded"]["rate"]))
    assert "fert_step_from_previous_fleet" in result["by_fleet"]["2"]["seed_level"]
    start = result["by_fleet"]["2"]["seed_level"]["fert_minus_initial"]  # the fleet's lift over the bootstrap
    assert start["mean"] == pytest.approx(100 * (result["results"]["fert"]["2"]["thresholded"]["rate"]
                                                 - result["initial"]["thresholded"]["rate"]))
    assert result["test_population_seeds"] == [_small().fleet.test_population_seed(0)]
    for run in result["runs"]:  # per-robot outcomes, on test robots only
        assert sorted(run["successes_by_robot"]) == ["test-0000", "test-0001"]
        assert sum(run["successes_by_robot"].values()) == round(run["rate"] * run["trials"])
    # every cell's final policy is in MLflow, tagged, and loads back by the URI its JSON row names
    from mlflow import MlflowClient

    from components.registry.model_registry import PolicyRegistry

    registry = PolicyRegistry(tmp_path / "mlruns", load_settings().registry.model_copy(
        update={"experiment": fs.EXPERIMENT, "model_name": fs.MODEL_NAME}))
    logged = MlflowClient().search_runs([registry.experiment_id])
    cells = {(r["method"], r["fleet"]) for r in result["runs"] if r["method"] != "bc"} | {("bc", 1)}
    assert {(r.data.tags["method"], int(r.data.tags["fleet_size"])) for r in logged} == cells and len(logged) == len(cells)
    tags = logged[0].data.tags
    assert tags["seed"] == "0" and tags["task"] == "pick-place" and tags["commit"]
    assert tags["population_seed"] == "0" and tags["test_population_seed"] == str(result["test_population_seeds"][0])
    fert_row = next(r for r in result["runs"] if r["method"] == "fert" and r["fleet"] == 2)
    assert fert_row["model_uri"].startswith(f"models:/{fs.MODEL_NAME}/")
    assert registry.load_uri(fert_row["model_uri"]).obs_dim == 11
    fert_rounds = [r["rounds"] for r in result["runs"] if r["method"] == "fert"]
    assert all(len(rounds) == plan.rounds for rounds in fert_rounds)
    for run in result["runs"]:  # validation selection: the kept policy's score never goes down
        kept = [r["validation_kept"] for r in run["rounds"]]
        assert kept == sorted(kept), run["method"]
    for run in fert_rounds:  # what a cell stored: a fleet round adds episodes (and their segments) to disk
        stored = [r["stored_bytes"] for r in run]
        assert all(s["episodes"] > 0 and s["store"] > 0 for s in stored)
        assert [s["episodes"] for s in stored] == sorted(s["episodes"] for s in stored)


def test_seeds_run_in_worker_processes_give_the_same_study(studies, tmp_path):
    plan, alone, pooled = studies.seeds_plan, studies.alone, studies.pooled

    def figures(result):
        return result["initial"], result["results"], [
            {k: v for k, v in run.items() if k != "seconds"} | {"rounds": [
                # seconds and bytes on disk are the machine's (LanceDB and Parquet files carry ids and times)
                {k: v for k, v in r.items() if not k.endswith("seconds") and k != "stored_bytes"} for r in run["rounds"]]}
            for run in result["runs"]]

    assert [r["seed"] for r in pooled["runs"]] == [0, 0, 1, 1]  # seed order kept: bc, fert per seed
    assert figures(pooled) == figures(alone)

    # test robots: fresh per seed (a new population each), never the validation or tuning robots
    settings = _small()
    populations = alone["test_population_seeds"]
    assert len(set(populations)) == 2 and [r["test_population_seed"] for r in alone["runs"]] == [
        populations[0], populations[0], populations[1], populations[1]]
    profiles = [RobotProfile.from_id("test-0000", settings.sim.model_copy(update={"population_seed": p}))
                for p in populations]
    assert not np.array_equal(profiles[0].action_gain, profiles[1].action_gain)
    tested = {r for run in alone["runs"] for r in run["successes_by_robot"]}
    cell = fs.cell_settings(settings, plan, "fert", tmp_path / "cell", seed=0)
    decided = set(cell.fleet.heldout_ids()) | set(settings.fleet.tuning_ids(plan.heldout_robots)) | set(
        settings.fleet.robot_ids(max(plan.fleet_sizes)))
    assert tested and not tested & decided


def test_a_tuning_plan_scores_on_tuning_robots_and_first_seed_takes_unused_seeds(tmp_path, monkeypatch):
    """--tuning: the figures settings are chosen on come from tuning robots of the sim's own population,
    never test robots; --first-seed: a re-measurement runs seeds (so test populations) no run used."""
    from components.policy.factory import make_policy

    settings = fs.plan_settings(fs.PLANS["pack"], load_settings())
    policy = make_policy(17, 3, settings.policy)  # untrained: only who is scored is checked
    tuning = replace(fs.QUICK["pack"], heldout_robots=2, trials_per_robot=1, robots="tuning")
    score = fs.evaluate(settings, tuning, policy, seed=3)
    assert sorted(score.successes_by_robot) == ["tuning-0000", "tuning-0001"]
    assert score.population_seed == settings.sim.population_seed and score.trials == 2
    test = fs.evaluate(settings, replace(tuning, robots="test"), policy, seed=3)
    assert sorted(test.successes_by_robot) == ["test-0000", "test-0001"]
    assert test.population_seed == settings.fleet.test_population_seed(3) != score.population_seed

    plan = replace(fs.QUICK["pack"], seeds=2, first_seed=4)
    assert plan.seed_ids == [4, 5]
    ran: list[int] = []

    class Stop(Exception):
        pass

    def first_seed_only(settings, plan, seed, scratch):
        ran.append(seed)
        raise Stop

    monkeypatch.setattr(fs, "run_seed", first_seed_only)
    with pytest.raises(Stop):
        fs.run(plan, "unused", settings=_small(tmp_path / "root"), log_models=False, cells=tmp_path / "cells")
    assert ran == [4]


def test_cells_drive_the_product_and_gate_on_validation_robots(tmp_path):
    """A cell is a product root: the gate evaluates on validation robots (not the reported held-out
    ones) and promotes a candidate that is not worse on the same trials."""
    settings = load_settings()
    plan = replace(fs.QUICK["pickplace"], validation_robots=3, validation_trials=2)
    cell = fs.cell_settings(settings, plan, "fert_learned", tmp_path / "cell", seed=4)
    assert cell.root == tmp_path / "cell" and cell.seed == 4
    assert cell.train.method == "fert" and cell.fert.encoder == "learned"
    assert cell.fleet.heldout_ids() == ["validation-0000", "validation-0001", "validation-0002"]
    assert cell.fleet.steps_per_robot == plan.steps_per_robot  # the plan's collection time is what the fleet runs
    assert not set(cell.fleet.heldout_ids()) & set(settings.fleet.test_ids(plan.heldout_robots))
    assert cell.evaluation.trials_for(3) == 2
    from components.registry.gate import two_proportion_gate

    assert two_proportion_gate(5, 6, 5, 6, cell.registry.gate_alpha).promote  # equal: kept
    assert not two_proportion_gate(4, 6, 5, 6, cell.registry.gate_alpha).promote  # worse: refused


def test_a_stopped_study_resumes_from_its_finished_seeds_and_can_report_them(studies, monkeypatch):
    """--cells keeps each seed as it finishes: a rerun runs only the missing seeds (here none), and
    --finished-only reports what the folder holds, saying which seeds of the plan those are."""
    cells, plan = studies.alone_cells, studies.seeds_plan
    assert sorted(p.name for p in cells.glob("seed-*.json")) == ["seed-0.json", "seed-1.json"]
    assert not list(cells.glob("cell-*"))  # every cell's root is gone once its seed is kept

    def no_run(*args, **kwargs):
        raise AssertionError("a kept seed was run again")

    run_seed = fs.run_seed
    monkeypatch.setattr(fs, "run_seed", no_run)
    monkeypatch.setattr(fs, "RESULTS", studies.results)
    again = fs.run(plan, "again", settings=_small(studies.tiny_root.parent / "again"), log_models=False, cells=cells)
    assert again["results"] == studies.alone["results"] and again["initial"] == studies.alone["initial"]
    assert again["seeds_reported"] == [0, 1]

    (cells / "seed-1.json").unlink()  # as if the run had been stopped during seed 1
    one = fs.run(plan, "one", settings=_small(studies.tiny_root.parent / "one"), log_models=False, cells=cells,
                 finished_only=True)
    assert one["seeds_reported"] == [0] and one["plan"]["seeds"] == 2
    assert one["test_population_seeds"] == studies.alone["test_population_seeds"][:1]
    assert "1 seeds (of 2 planned; seeds [0])" in fs.render_section(one)

    # stopped inside seed 1 after its last cell: every finished cell is read back, none is run again
    assert len(list((cells / "cells-done").glob("seed-1-*.json"))) == len(plan.methods) * len(plan.fleet_sizes) + 1

    def no_cell(*args, **kwargs):
        raise AssertionError("a kept cell was run again")

    monkeypatch.setattr(fs, "run_seed", run_seed)
    monkeypatch.setattr(fs, "run_study_cell", no_cell)
    resumed = fs.run(plan, "resumed", settings=_small(studies.tiny_root.parent / "resumed"), log_models=False,
                     cells=cells)
    assert resumed["results"] == studies.alone["results"] and resumed["seeds_reported"] == [0, 1]


def test_a_seed_kept_by_another_plan_runs_again_for_only_its_missing_cells(studies, monkeypatch, tmp_path):
    """The pack study ran its 96-robot cells first and the smaller fleets after, into one folder: a
    seed file of the first plan does not stand for the second, which runs only the cells the folder
    lacks (bc is read back under its own fleet size: it never sees the fleet); a report of a plan
    counts only that plan's cells of a seed file that holds more."""
    cells = tmp_path / "cells"
    shutil.copytree(studies.alone_cells, cells)
    wider = replace(studies.seeds_plan, fleet_sizes=(1, 2))
    assert fs.kept_seed(cells, 0, studies.seeds_plan) is not None and fs.kept_seed(cells, 0, wider) is None
    ran = []

    class Stop(Exception):
        pass

    def record(settings, plan, method, fleet, seed, scratch, keep_root=False):
        ran.append((seed, method, fleet))
        raise Stop

    monkeypatch.setattr(fs, "run_study_cell", record)
    monkeypatch.setattr(fs, "RESULTS", studies.results)
    with pytest.raises(Stop):
        fs.run(wider, "wider", settings=_small(tmp_path / "wider"), log_models=False, cells=cells)
    assert ran == [(0, "fert", 1)]

    for seed in (0, 1):  # seed files that hold a cell of another plan too
        data = json.loads((cells / f"seed-{seed}.json").read_text())
        data["rows"].append({**data["rows"][-1], "fleet": 1})
        (cells / f"seed-{seed}.json").write_text(json.dumps(data))
    narrow = fs.run(studies.seeds_plan, "narrow", settings=_small(tmp_path / "narrow"), log_models=False, cells=cells,
                    finished_only=True)
    assert narrow["results"] == studies.alone["results"] and narrow["seeds_reported"] == [0, 1]


def test_pack_targets_judge_the_gap_with_its_seed_level_interval_and_growth_after_8_robots():
    """fs.TARGETS["pack"] against made-up figures: each criterion holds or fails on its own figure."""
    def cell(rate: float) -> dict:
        return {"thresholded": {"rate": rate, "successes": round(rate * 768), "trials": 768}}

    def level(gap: float, low: float, steps: dict[int, float]) -> dict:
        out = {"96": {"seed_level": {"fert_minus_filtered_bc": {"mean": gap, "ci95": [low, gap + 2]}}}}
        for n, step in steps.items():
            out.setdefault(str(n), {"seed_level": {}})["seed_level"]["fert_step_from_previous_fleet"] = {"mean": step}
        return out

    sizes = (1, 8, 32, 96)
    table = {"fert": {str(n): cell(r) for n, r in zip(sizes, (0.70, 0.72, 0.90, 0.96))},
             "filtered_bc": {str(n): cell(r) for n, r in zip(sizes, (0.70, 0.72, 0.85, 0.92))}}
    growing = level(4.0, 0.5, {8: -1.0, 32: 18.0, 96: 6.0})  # a dip before 8 robots is not judged
    met = fs.study_targets(fs.TARGETS["pack"], table, growing, {"rate": 0.60}, sizes, 0.95)
    assert met["initial_in_range"] and met["fert_largest_fleet_meets"] and met["gap_meets"]
    assert met["fert_grows_with_fleet"] is True
    assert met["residual_failures_removed"] == pytest.approx(0.5)

    flat = level(4.0, -0.5, {8: 5.0, 32: 7.0, 96: -0.7})  # the same gap, its interval crossing 0
    missed = fs.study_targets(fs.TARGETS["pack"], table, flat, {"rate": 0.80}, sizes, 0.95)
    assert not missed["initial_in_range"] and not missed["gap_meets"] and missed["fert_grows_with_fleet"] is False
    assert "(target ≥ +3 pts with the interval above 0: **False**)" in "\n".join(
        fs._target_lines({"targets": missed, "plan": {"fleet_sizes": list(sizes)}}))


def test_overrides_are_validated_as_params_yaml_is():
    """--sim-set / --policy-set / --fert-set: a list becomes the field's tuple, and a misspelt key or a
    wrong type is refused naming the flag and the key (model_copy would have taken both silently)."""
    plan = replace(fs.QUICK["pickplace"], sim_overrides={"cameras": ["scene", "gripper"]},
                   policy_overrides={"kind": "vision"})
    settings = fs.plan_settings(plan, load_settings())
    assert settings.sim.cameras == ("scene", "gripper") and settings.policy.kind == "vision"
    with pytest.raises(ValueError, match=r"--sim-set .*motion_noise: Extra inputs are not permitted"):
        fs.plan_settings(replace(plan, sim_overrides={"motion_noise": 0.2}), load_settings())
    with pytest.raises(ValueError, match=r"--policy-set .*kind"):
        fs.plan_settings(replace(plan, policy_overrides={"kind": "mlpp"}), load_settings())


def test_a_study_resumes_from_committed_cell_records_on_a_fresh_clone(studies, monkeypatch, tmp_path):
    """A study spans sessions: a --cells folder's records (JSON) are committed, its cells' roots and
    final policies are not (.gitignore). On a fresh clone the kept seeds are reported, not run again;
    the cells whose policy stayed on the other machine are reported without a model URI."""
    repo = Path(fs.__file__).resolve().parents[1]

    def ignored(path: str) -> bool:
        import subprocess

        return subprocess.run(["git", "check-ignore", "-q", path], cwd=repo).returncode == 0

    assert not ignored("benchmarks/results/cells_x/seed-0.json")
    assert not ignored("benchmarks/results/cells_x/cells-done/seed-0-fert-96.json")
    assert ignored("benchmarks/results/cells_x/policies/0-fert-96.pt")
    assert ignored("benchmarks/results/cells_x/cell-0-fert-96/registry.db")

    cells = tmp_path / "cells"
    shutil.copytree(studies.alone_cells, cells, ignore=shutil.ignore_patterns("policies"))  # what a clone holds
    for record in [*cells.glob("seed-*.json"), *cells.glob("cells-done/*.json")]:  # written on another machine
        record.write_text(record.read_text().replace(str(studies.alone_cells), "/another-machine/cells"))
    monkeypatch.setattr(fs, "run_study_cell", lambda *a, **k: pytest.fail("a committed cell was run again"))
    monkeypatch.setattr(fs, "RESULTS", studies.results)
    fresh = fs.run(studies.seeds_plan, "fresh", settings=_small(tmp_path / "fresh"), log_models=True, cells=cells)
    assert fresh["results"] == studies.alone["results"] and fresh["seeds_reported"] == [0, 1]
    assert [run["model_uri"] for run in fresh["runs"]] == [""] * len(fresh["runs"])
