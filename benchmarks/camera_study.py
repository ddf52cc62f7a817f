"""The camera study (issue 47), judged by the criteria committed before it ran.

    python -m benchmarks.camera_study      # reads the study's JSON, writes camera_study.json + .png

The study itself is ``benchmarks/fleet_scaling.py`` on cameras, the command in
``docs/journal/2026-12-07-camera-study-criteria.md`` (its ``--cells`` folder keeps every finished
cell, so it resumes across sessions); it writes ``fleet_scaling_pickplace_camera.json``. This
module only reads that JSON and the state run of the same plan and seeds
(``fleet_scaling_pickplace_state200.json``, the criteria's addendum; ``--state`` names another) and
states, per criterion, its figure, its seed-level interval and whether it holds:

1. the fleet teaches a camera policy: FERT at 96 robots − the initial policy, paired over seeds;
2. FERT on pixels beats success filtering: FERT − filtered BC at 96 robots, paired;
3. more robots help: FERT at 96 − FERT at 32 robots, paired;
4. cameras against state (reported, no direction tested): camera FERT at 96 − state FERT at 96,
   Welch's interval over the two studies' seeds (not paired: different seeds, test populations
   and code), and each one's initial policy, training seconds per round and bytes stored.

The stopping rule was stated with the criteria: seeds 0-3 first, then more until the seeds
``seeds_needed`` asks for the gap of criterion 2 are reached, or 12. Until then the criteria are
reported as interim (``judged: false``), never as met or missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from components.evaluation.intervals import welch_seed_interval

RESULTS = Path(__file__).resolve().parent / "results"
CAMERA = "fleet_scaling_pickplace_camera"
STATE = "fleet_scaling_pickplace_state200"  # the same plan, seeds and 200 steps a robot, on state (criteria addendum)
NAME = "camera_study"
CRITERIA_FILE = "docs/journal/2026-12-07-camera-study-criteria.md"
FIRST_SEEDS, MAX_SEEDS = 4, 12  # the stopping rule, as committed with the criteria
PAIRED = {  # criterion -> (fleet size, seed_level key of fleet_scaling.seed_level)
    "fleet_teaches_camera_policy": ("96", "fert_minus_initial"),
    "fert_beats_filtered_bc": ("96", "fert_minus_filtered_bc"),
    "more_robots_help": ("96", "fert_step_from_previous_fleet"),
}


def per_seed(study: dict, method: str, fleet: int) -> dict[int, float]:
    """Seed -> thresholded success rate of ``method`` at ``fleet`` robots."""
    return {r["seed"]: r["rate"] for r in study["runs"] if r["method"] == method and r["fleet"] == fleet}


def stopping_rule(study: dict) -> dict:
    """Whether the committed rule says the study is done, and why."""
    seeds = len(study["seeds_reported"])
    gap = study["by_fleet"].get("96", {}).get("seed_level", {}).get("fert_minus_filtered_bc", {})
    needed = gap.get("seeds_needed")
    done = seeds >= MAX_SEEDS or (seeds >= FIRST_SEEDS and needed is not None and seeds >= needed)
    return {"seeds": seeds, "seeds_needed_for_the_gap": needed, "first_seeds": FIRST_SEEDS, "max_seeds": MAX_SEEDS,
            "done": done}


def paired_criteria(study: dict, judged: bool) -> dict:
    """Criteria 1-3: each one's seed-level figure (points) and whether its interval is above 0."""
    out = {}
    for name, (fleet, key) in PAIRED.items():
        level = study["by_fleet"].get(fleet, {}).get("seed_level", {}).get(key)
        if level is None:
            out[name] = {"figure": None, "judged": False, "holds": None, "why": f"no {key} at {fleet} robots yet"}
            continue
        ci = level["ci95"]
        out[name] = {"a": level["a"], "b": level["b"], "mean_points": level["mean"], "ci95_points": ci,
                     "bootstrap_ci95_points": level["bootstrap_ci95"], "seeds": level["seeds"],
                     "judged": judged, "holds": (ci is not None and ci[0] > 0) if judged else None}
    return out


def _median_train_seconds(study: dict, method: str, fleet: int) -> float | None:
    rounds = [r for run in study["runs"] if run["method"] == method and run["fleet"] == fleet for r in run["rounds"]]
    seconds = [r["train_seconds"] for r in rounds if "train_seconds" in r]
    return statistics.median(seconds) if seconds else None


def _stored_bytes(study: dict, method: str, fleet: int) -> dict | None:
    """Median over seeds of what a cell stored after its last round (None: the run did not record it)."""
    last = [run["rounds"][-1].get("stored_bytes") for run in study["runs"]
            if run["method"] == method and run["fleet"] == fleet and run["rounds"]]
    last = [b for b in last if b]
    if not last:
        return None
    return {part: statistics.median(b[part] for b in last) for part in last[0]}


def cameras_vs_state(camera: dict, state: dict, confidence: float) -> dict:
    """Criterion 4 (reported): camera FERT at 96 robots beside state FERT at 96, Welch over seeds."""
    cam, st = per_seed(camera, "fert", 96), per_seed(state, "fert", 96)
    side = {}
    for label, study, rates in (("camera", camera, cam), ("state", state, st)):
        side[label] = {"fert_96": statistics.fmean(rates.values()) if rates else None, "seeds": sorted(rates),
                       "initial": study["initial"]["thresholded"]["rate"],
                       "train_seconds_per_round": _median_train_seconds(study, "fert", 96),
                       "stored_bytes_after_last_round": _stored_bytes(study, "fert", 96),
                       "json": study.get("_json")}
    out: dict = {"sides": side}
    if cam and st:
        d = welch_seed_interval(list(cam.values()), list(st.values()), confidence)
        out["camera_minus_state_points"] = {"mean": 100 * d.mean, "ci95": [100 * d.low, 100 * d.high],
                                            "seeds": list(d.seeds), "interval": "Welch, unpaired seeds"}
    return out


def criteria_commit(root: Path) -> str:
    """The commit that first added the criteria file (they were stated before any run)."""
    run = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "--", CRITERIA_FILE], cwd=root,
                         capture_output=True, text=True, check=False)
    return run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "not recorded"


def judge(camera: dict, state: dict, confidence: float = 0.95) -> dict:
    rule = stopping_rule(camera)
    return {
        "question": "does the fleet teach a camera policy, does FERT beat filtered BC on pixels, do more robots help, "
                    "and what do cameras cost against state (pick-place, test robots)",
        "criteria_file": CRITERIA_FILE, "stopping_rule": rule,
        "criteria": paired_criteria(camera, judged=rule["done"]),
        "cameras_vs_state": cameras_vs_state(camera, state, confidence),
        "camera_results": camera["results"], "camera_initial": camera["initial"]["thresholded"],
        "seeds_reported": camera["seeds_reported"], "test_population_seeds": camera["test_population_seeds"],
        "command": camera.get("command", ""),
    }


def plot(result: dict, camera: dict, state: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [("initial", None), ("bc", 32), ("filtered_bc", 32), ("fert", 32), ("filtered_bc", 96), ("fert", 96)]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    initial = dict(zip(camera["seeds_reported"], camera["initial"]["thresholded"]["per_seed"]))
    for x, (method, fleet) in enumerate(columns):
        rates = initial if method == "initial" else per_seed(camera, method, fleet)
        ys = [100 * rates[s] for s in sorted(rates)]
        ax.scatter([x] * len(ys), ys, color="tab:blue", alpha=0.6, s=18)
        if ys:
            ax.hlines(statistics.fmean(ys), x - 0.3, x + 0.3, color="tab:blue")
    st = [100 * v for v in per_seed(state, "fert", 96).values()]
    x = len(columns)
    ax.scatter([x] * len(st), st, color="tab:green", alpha=0.6, s=18)
    if st:
        ax.hlines(statistics.fmean(st), x - 0.3, x + 0.3, color="tab:green")
    labels = ["initial"] + [f"{m}\n{n} robots" for m, n in columns[1:]] + ["state FERT\n96 robots"]
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("test-robot success, % (one dot per seed)")
    rule = result["stopping_rule"]
    ax.set_title(f"Pick-place on cameras: {rule['seeds']} seeds "
                 f"({'final' if rule['done'] else 'interim: the stopping rule is not reached'})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--camera", default=CAMERA, help="the camera study's results stem")
    parser.add_argument("--state", default=STATE, help="the state study's results stem")
    parser.add_argument("--out", default=NAME)
    args = parser.parse_args()
    studies = []
    for stem in (args.camera, args.state):
        path = RESULTS / f"{stem}.json"
        if not path.exists():
            raise SystemExit(f"{path} is missing: run the study first (the command is in {CRITERIA_FILE})")
        studies.append({**json.loads(path.read_text()), "_json": str(path.relative_to(RESULTS.parent.parent))})
    camera, state = studies
    result = judge(camera, state)
    result["criteria_commit"] = criteria_commit(RESULTS.parent.parent)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, camera, state, RESULTS / f"{args.out}.png")
    print(json.dumps({k: result[k] for k in ("stopping_rule", "criteria", "cameras_vs_state")}, indent=1))


if __name__ == "__main__":
    main()
