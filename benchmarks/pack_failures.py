"""Where a pack policy trained on clean demos fails, and on which robots. Tuning robots only.

    python -m benchmarks.pack_failures                       # history transformer, 4000 steps, seed 0 (~4 min)
    python -m benchmarks.pack_failures --class mlp --seed 1  # another policy_ceiling cell
    python -m benchmarks.pack_failures --quick               # smoke run (tiny budgets)

Trains one ``policy_ceiling`` cell (the same settings, demos and trial stream: its rate is that
cell's), then reads the failed trials frame by frame against the demonstrator. The scripted expert is
memoryless, so it can be asked what it would have done on each observation the policy saw:

* ``jaw_split``: the first step of a run of ``RUN`` steps in which the executed jaw command (closed
  > 0) differs from the expert's, with the stage and the object's distance from the container there
  (pack's expert makes a fist only once the object lies within ``container_radius`` + 1 cm of it);
* per robot: its failures beside the distance between its object region's centre and its
  container region's centre (``RobotProfile``), the quirk that sets how close the object starts to the
  container.

It measures the failures of one cell and chooses nothing. Writes benchmarks/results/pack_failures.json + .png.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from benchmarks.pack_difficulty import bootstrap_policy, commit
from benchmarks.policy_ceiling import FULL, QUICK, Grid, cell_settings, tuning_trials
from components.sim.factory import make_expert
from components.sim.pack import OBS_FIELDS, STAGES
from components.sim.profile import RobotProfile

RESULTS = Path(__file__).resolve().parent / "results"
RUN = 5  # steps of disagreement that count as a split (one step is a flicker at a threshold)
_OPENING = OBS_FIELDS.index("opening")
_BOX_REL_OBJ = [OBS_FIELDS.index("container_rel_object_x"), OBS_FIELDS.index("container_rel_object_y")]


def jaw_split(executed: np.ndarray, expert: np.ndarray) -> int:
    """The first step of ``RUN`` consecutive jaw disagreements (-1: none)."""
    differs = np.sign(executed) != np.sign(expert)
    runs = np.convolve(differs.astype(int), np.ones(RUN, dtype=int), "valid") == RUN
    return int(np.argmax(runs)) if runs.any() else -1


def read_failure(episode, expert) -> dict:
    """A failed trial against the demonstrator: where the jaws split, and what the robot saw there."""
    states, actions = episode.states, episode.actions
    stages = episode.extras["stage"].astype(int)
    split = jaw_split(actions[:, 2], expert(states)[:, 2])
    at = {} if split < 0 else {
        "stage": STAGES[stages[split]], "opening": float(states[split, _OPENING]),
        "policy_closes": bool(actions[split, 2] > 0),
        "object_to_container": float(np.linalg.norm(states[split, _BOX_REL_OBJ]))}
    return {"robot": episode.robot_id, "reached": STAGES[episode.stage_reached], "jaw_split_step": split, **at}


def run(name: str, seed: int, grid: Grid, steps: int) -> dict:
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pack_failures_") as scratch:
        settings = cell_settings(name, seed, grid, Path(scratch))
        policy, info = bootstrap_policy(settings, steps)
        episodes = tuning_trials(settings, policy, grid, "bc")
    robots = settings.fleet.tuning_ids(grid.robots)
    expert = make_expert(settings.sim)
    failures = [read_failure(e, expert) for e in episodes if not e.success]
    per_robot = []
    for robot in robots:
        profile = RobotProfile.from_id(robot, settings.sim)
        per_robot.append({"robot": robot, "failures": sum(f["robot"] == robot for f in failures),
                          "object_to_container_region": float(np.linalg.norm(profile.object_center - profile.goal_center))})
    near = sorted(per_robot, key=lambda r: r["object_to_container_region"])[: len(per_robot) // 4]
    split = [f for f in failures if f["jaw_split_step"] >= 0]
    return {
        "benchmark": "pack_failures", "commit": commit(), "class": name, "seed": seed, "steps": steps,
        "robots": len(robots), "trials": len(episodes), "successes": len(episodes) - len(failures),
        "rate": 1 - len(failures) / len(episodes), "final_loss": info["final_loss"],
        "failures_by_stage": dict(Counter(f["reached"] for f in failures)),
        "jaw_splits": {"failures": len(split), "by_stage": dict(Counter(f["stage"] for f in split)),
                       "policy_closes": sum(f["policy_closes"] for f in split)},
        "nearest_quarter": {"robots": len(near), "failures": sum(r["failures"] for r in near),
                            "max_region_distance": near[-1]["object_to_container_region"] if near else None},
        "per_robot": per_robot, "failed_trials": failures, "seconds": time.perf_counter() - started,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rows = result["per_robot"]
    left.scatter([r["object_to_container_region"] for r in rows], [r["failures"] for r in rows], s=14)
    left.set_xlabel("robot's object region centre to its container region centre")
    left.set_ylabel(f"failed trials of {result['trials'] // result['robots']}")
    split = [f for f in result["failed_trials"] if f["jaw_split_step"] >= 0]
    colors = ["tab:red" if f["policy_closes"] else "tab:blue" for f in split]
    right.scatter([f["object_to_container"] for f in split], [f["jaw_split_step"] for f in split], c=colors, s=14)
    right.set_xlabel("object to container where the jaws split (red: policy closes, blue: opens)")
    right.set_ylabel("step of the split")
    fig.suptitle(f"pack, {result['class']} seed {result['seed']} ({result['steps']} steps): "
                 f"{result['rate']:.1%} on {result['robots']} tuning robots; {len(split)} of "
                 f"{result['trials'] - result['successes']} failures split from the expert's jaw", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--class", dest="name", default="history_transformer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--quick", action="store_true", help="2 demo robots, 20 steps, 4 robots x 1 trial")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    grid, steps, name = (QUICK, 20, "pack_failures_quick") if args.quick else (FULL, args.steps, "pack_failures")
    result = run(args.name, args.seed, grid, steps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{name}.png")
    near = result["nearest_quarter"]
    print(f"{args.name} seed {args.seed}: {result['rate']:.1%} ({result['successes']}/{result['trials']}); "
          f"{near['failures']} of {result['trials'] - result['successes']} failures on the {near['robots']} robots "
          f"whose object starts nearest their container; jaw splits {result['jaw_splits']}")


if __name__ == "__main__":
    main()
