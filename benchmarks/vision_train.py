"""The scheduler on the camera training workflow: training frames/s of ``auto`` vs the best baseline.

    python -m benchmarks.vision_train            # 64x64 cameras, 8 steps/iteration, 4 rounds (~25-40 min on 2 cores)
    python -m benchmarks.vision_train --quick    # 32x32 cameras, 4 steps/iteration, 3 rounds (~8-12 min)
    python -m benchmarks.vision_train --tiny     # 16x16, batch 16: code path only (tests)

The workload is ``policy.kind: vision`` with PolicyConfig's defaults (conv encoder per camera,
spatial softmax, MLP head, ``augment_shift`` 4), ``train.batch_size`` 256, validation on
``train.validation_robots`` robots whose simulators render both cameras, trained on a camera
training set built by the product: pick-place expert demos plus fleet-like episodes (the expert
executed with the fleet's exploration, ``make_exploration``) -> ``FrameTable.from_corpus(...,
cameras=...)`` -> ``make_trainer``. Its workflow is ``sample -> augment -> learn`` with ``validate``
beside it (training/workflow.py).

Rows (each runs the same iterations of the same training set):

* ``auto``: what ``scheduler.plan: auto`` picks (``Trainer.choose("auto")``: profile -> M2Flow ->
  Rose -> validated against sequential), decided once before the rounds, on this run's machine load;
* ``sequential``: the bit-identical reference (every op 1 thread, BLAS 1);
* ``default-threads``: one thread of control, every op at torch's default intra-op threads (the
  learner included: its numerics differ from the 1-thread reference by float rounding);
* ``coarse-processes``: RLinf-style, every component in a worker process of its own
  (``trainer.runtime.coarse_processes()``);
* ``dataloader(workers=N)``, N in {1, 2}: what a user writes without our scheduler: a torch
  ``Dataset`` whose ``__getitem__`` returns one frame's images shifted by a seeded augmentation of
  its own (the product's ``augment_and_pack`` on that sample) packed with its state, a
  ``DataLoader`` (batch_size = train.batch_size, the product's batch rows, persistent workers), and
  the product's ``bc_step`` loop at the learner's thread count (``train.threads``, as ours: at torch's
  default 2 threads the main process's learn and validation ran 10-20x slower on the loaded 2-core
  host, an oversubscription no user would keep), validation inline each iteration. Not
  bit-identical to ours: its shifts come from a per-sample stream.

The best baseline is the fastest of sequential, default-threads, coarse-processes and the
dataloader rows, by median over capacity-qualified rounds. Measurement, capacity qualification,
paired ratios and the span bound are benchmarks/scheduler.py's functions (imported, not copied).
Frames/s = batch_size x steps_per_iteration / median iteration seconds (iteration 0 of every run
is warm-up and dropped; it pays worker start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from benchmarks.scheduler import (
    interleaved,
    load,
    log,
    measured_span_bound,
    probe_after_round,
    qualify,
    ratio_per_round,
    work_bound,
)
from components.config import Settings, load_settings
from components.scheduler.profiler import Span, Timeline, effective_cores

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "vision_train"
TARGET = 1.15  # issue #47 line 6: auto over the best baseline, capacity-qualified rounds, 2 cores
TORCH_DEFAULT_THREADS = torch.get_num_threads()  # read at import, before any plan sets a quota


@dataclass(frozen=True)
class Size:
    camera: int  # cameras are camera x camera RGB
    steps_per_iteration: int
    rounds: int
    iterations: int  # measured iterations per run (plus one warm-up)
    expert_robots: int
    fleet_robots: int
    episodes_per_robot: int
    batch_size: int | None = None  # None: train.batch_size
    validation_robots: int | None = None  # None: train.validation_robots
    dataloader_workers: tuple[int, ...] = (1, 2)
    max_steps: int | None = None  # None: sim.max_steps (validation rollouts run up to this many steps)
    scheduler: tuple[tuple[str, Any], ...] = ()  # scheduler settings changed (tiny: auto's measuring cut short)


SIZES = {
    # 64x64 is sim.camera's default; a 64x64 bc_step at batch 256 is ~0.8-1 s of one core, so
    # train's 50 steps/iteration would make one iteration ~45 s: 8 steps keep a round in minutes
    "full": Size(64, 8, 4, 2, expert_robots=4, fleet_robots=8, episodes_per_robot=4),
    "quick": Size(32, 4, 3, 2, expert_robots=4, fleet_robots=4, episodes_per_robot=2),
    "tiny": Size(16, 2, 1, 1, expert_robots=2, fleet_robots=2, episodes_per_robot=1, batch_size=16,
                 validation_robots=1, dataloader_workers=(1,), max_steps=30,
                 scheduler=(("profile_iterations", 2), ("validate_iterations", 1), ("validate_rounds", 1),
                            ("capacity_probe_attempts", 1), ("capacity_retry_wait_s", 0.0))),
}


# ---------------------------------------------------------------------------- the workload
def camera_settings(settings: Settings, size: Size, root: Path) -> Settings:
    """params.yaml's settings with both cameras at ``size.camera``, the vision policy at its
    defaults, this study's steps per iteration and a fresh root (no cached plan)."""
    sim = settings.sim.model_copy(update={"cameras": ("scene", "gripper"), "camera": settings.sim.camera.model_copy(
        update={"width": size.camera, "height": size.camera}), **({"max_steps": size.max_steps} if size.max_steps else {})})
    train = settings.train.model_copy(update={"steps_per_iteration": size.steps_per_iteration, **(
        {"batch_size": size.batch_size} if size.batch_size else {}), **(
        {"validation_robots": size.validation_robots} if size.validation_robots else {})})
    policy = type(settings.policy)(kind="vision")  # PolicyConfig's vision defaults
    scheduler = settings.scheduler.model_copy(update=dict(size.scheduler))
    return settings.model_copy(update={"root": root, "sim": sim, "train": train, "policy": policy, "scheduler": scheduler})


def camera_training_set(settings: Settings, size: Size) -> Any:
    """Expert demos + fleet-like episodes (the expert under the fleet's exploration), both cameras
    rendered, -> the FERT frame table's training set with its decoded frames."""
    from components.episodes.record import camera_key
    from components.fert.corpus import EpisodeList
    from components.fert.priority import FrameTable
    from components.sim.collect import run_episodes
    from components.sim.factory import make_expert, make_exploration

    sim = settings.sim
    expert = run_episodes(make_expert(sim), [f"expert-{i:04d}" for i in range(size.expert_robots)], sim,
                          size.episodes_per_robot, settings.seed, "expert")
    fleet = run_episodes(make_exploration(sim, make_expert(sim), settings.seed + 1),
                         [f"robot-{i:04d}" for i in range(size.fleet_robots)], sim, size.episodes_per_robot,
                         settings.seed + 1, "v1")
    keys = tuple(camera_key(c) for c in sorted(sim.cameras))
    table = FrameTable.from_corpus(EpisodeList([*expert, *fleet]), "expert", cameras=keys)
    return table.training_set(), {"expert_episodes": len(expert), "fleet_episodes": len(fleet),
                                  "fleet_successes": int(sum(e.success for e in fleet)), "frames": len(table)}


# ---------------------------------------------------------------------------- the DataLoader rows
class FrameDataset(torch.utils.data.Dataset):
    """One frame: its images shifted by a seeded augmentation of their own, packed with its state."""

    def __init__(self, spec: Any) -> None:
        self.states = spec.data.states
        self.actions = spec.data.actions
        self.images = spec.data.images
        self.layout, self.shift, self.seed = spec.layout, spec.policy.augment_shift, spec.seed

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        from components.training.augment import augment_and_pack

        sample, row = key  # sample: this draw's index in the whole run (its augmentation stream)
        frames = {cam.key: torch.from_numpy(self.images[cam.key][row][None]) for cam in self.layout.cameras}
        packed = augment_and_pack(torch.from_numpy(self.states[row][None]), frames, self.layout, self.shift,
                                  self.seed, sample)
        return packed[0], torch.from_numpy(self.actions[row])


class RunBatches(torch.utils.data.Sampler):
    """The product's batch rows (``bc.batch_indices``, the same frames ours draws), one batch per step."""

    def __init__(self, spec: Any, iterations: int) -> None:
        self.spec, self.iterations = spec, iterations

    def __iter__(self):  # type: ignore[no-untyped-def]
        from components.training.bc import as_weights, batch_indices

        s = self.spec
        weights = as_weights(s.data.weights)
        for i in range(self.iterations):
            rows = batch_indices(len(s.data.states), weights, s.batch_size, s.steps_in(i), s.seed, i).numpy()
            for k, step in enumerate(rows):
                base = (i * s.steps_per_iteration + k) * s.batch_size
                yield [(base + j, int(r)) for j, r in enumerate(step)]

    def __len__(self) -> int:
        return sum(self.spec.steps_in(i) for i in range(self.iterations))


class DataLoaderRow:
    """A user's loop: DataLoader workers prepare batches; learn and validate in the main process."""

    def __init__(self, spec: Any, workers: int) -> None:
        if spec.policy.actions() != 1:
            raise ValueError("the DataLoader row trains one-action vision policies (policy.vision_chunk = 1)")
        self.spec, self.workers = spec, workers
        self.name = f"dataloader(workers={workers})"

    def run(self, iterations: int) -> Any:
        from components.training.bc import bc_step
        from components.training.workflow import Learner, Validator, op_validate

        spec = self.spec
        before = torch.get_num_threads()
        torch.set_num_threads(spec.learner_threads)  # our learner's count: bc_step's numerics as ours
        try:
            learner, validator = Learner(spec), Validator(spec)
            loader = torch.utils.data.DataLoader(FrameDataset(spec), batch_sampler=RunBatches(spec, iterations),
                                                 num_workers=self.workers, persistent_workers=self.workers > 0)
            batches = iter(loader)
            spans, iteration_s, losses, records = [], [], [], {}
            for i in range(iterations):
                start = time.perf_counter()
                params = {k: v.detach().clone() for k, v in learner.policy.state_dict().items()}
                t = time.perf_counter()
                records[i] = op_validate(validator, {"iteration": i}, {"params": params})["valm"]
                spans.append(Span("validate", f"validate[{i}]", "validator", "main", i, t, time.perf_counter(), 0))
                for _ in range(spec.steps_in(i)):
                    t = time.perf_counter()
                    obs, actions = next(batches)
                    t_learn = time.perf_counter()
                    spans.append(Span("load", f"load[{i}]", "loader", "main", i, t, t_learn, 0))
                    targets = learner.policy.act_norm.normalize(actions)
                    losses.append(bc_step(learner.policy, learner.optimizer, obs, targets, spec.batch_size, None,
                                          learner.dense, None))
                    spans.append(Span("learn", f"learn[{i}]", "learner", "main", i, t_learn, time.perf_counter(), 0))
                iteration_s.append(time.perf_counter() - start)
            del batches, loader  # persistent workers exit with their loader
        finally:
            torch.set_num_threads(before)
        final = {k: v.detach().clone() for k, v in learner.policy.state_dict().items()}
        return SimpleNamespace(iteration_s=iteration_s, records={}, timeline=Timeline(spans=spans),
                               final={"params": final}, losses=losses, validation=records)


class Rows:
    """What ``interleaved`` runs: scheduler plans through the trainer's runtime, DataLoader rows here."""

    def __init__(self, rt: Any, loaders: dict[str, DataLoaderRow]) -> None:
        self.rt, self.loaders, self.devices = rt, loaders, rt.devices

    def run(self, plan: Any, iterations: int) -> Any:
        row = self.loaders.get(plan.name)
        return row.run(iterations) if row is not None else self.rt.run(plan, iterations)


# ---------------------------------------------------------------------------- measurement
def losses_of(res: Any) -> list[float]:
    if hasattr(res, "losses"):
        return list(res.losses)
    per_iter = {k.version[0]: v for k, v in res.records.items() if k.state == "stats"}
    return [x for i in sorted(per_iter) for x in per_iter[i]["losses"]]


def validation_of(res: Any) -> list[Any]:
    """Each iteration's validation figures, in iteration order (scheduler records or a DataLoader row's)."""
    if hasattr(res, "validation"):
        return [res.validation[i] for i in sorted(res.validation)]
    per_iter = {k.version[0]: v for k, v in res.records.items() if k.state == "valm"}
    return [per_iter[i] for i in sorted(per_iter)]


def stage_split(res: Any) -> dict[str, float]:
    """Median ms per iteration each op spent (summed within an iteration; overlapping ops both count)."""
    per: dict[str, dict[int, float]] = {}
    for sp in res.timeline.spans:
        if sp.iteration >= 1 or len(res.iteration_s) == 1:
            per.setdefault(sp.op, {}).setdefault(sp.iteration, 0.0)
            per[sp.op][sp.iteration] += sp.duration
    return {op: statistics.median(v.values()) * 1e3 for op, v in sorted(per.items())}


def build_rows(trainer: Any, size: Size) -> tuple[Any, list[Any], dict[str, DataLoaderRow]]:
    """auto's choice (decided now, on this load) and every baseline row."""
    rt = trainer.runtime
    t = time.perf_counter()
    auto = trainer.choose("auto")
    log(f"auto chose {auto.plan.name} ({auto.source}) in {time.perf_counter() - t:.1f} s:\n{auto.plan.describe()}")
    seq = rt.sequential()
    default = rt.sequential(tuned=False).with_(name="default-threads", default_threads=TORCH_DEFAULT_THREADS,
                                               pinned_threads={"learner": TORCH_DEFAULT_THREADS})
    coarse = rt.coarse_processes().with_(name="coarse-processes")
    loaders = {r.name: r for r in (DataLoaderRow(trainer.spec, w) for w in size.dataloader_workers)}
    plans = [auto.plan.with_(name="auto"), seq, default, coarse, *(SimpleNamespace(name=n) for n in loaders)]
    return auto, plans, loaders


def measure(trainer: Any, size: Size, plans: list[Any], loaders: dict[str, DataLoaderRow]) -> tuple[dict, dict]:
    rt = trainer.runtime
    capacity: list[tuple[float, float]] = []
    rows = Rows(rt, loaders)
    meas = interleaved(rows, plans, size.iterations, size.rounds,
                       before_round=lambda r: capacity.append((effective_cores(rt.devices), 0.0)),
                       after_round=partial(probe_after_round, rt, capacity))
    qualified = qualify(meas, capacity, rt.devices, rt.cfg.capacity_qualify_fraction)
    log(f"{qualified['qualified_count']}/{size.rounds} rounds capacity-qualified; figures from {qualified['figures_from']}")
    return meas, qualified


def report(trainer: Any, size: Size, auto: Any, plans: list[Any], meas: dict, qualified: dict,
           workload: dict[str, Any], started: float, load_start: dict[str, float]) -> dict[str, Any]:
    from components.training.checkpoint import state_digest

    rt, spec = trainer.runtime, trainer.spec
    frames_per_iteration = spec.batch_size * spec.steps_per_iteration
    med = {p.name: meas[p.name]["median_s"] for p in plans}
    digests = {p.name: state_digest(meas[p.name]["last"].final["params"]) for p in plans}
    losses = {p.name: losses_of(meas[p.name]["last"]) for p in plans}
    validation = {p.name: validation_of(meas[p.name]["last"]) for p in plans}
    identical = {n: digests[n] == digests["sequential"] and losses[n] == losses["sequential"]
                 and validation[n] == validation["sequential"] for n in med}
    baselines = [p.name for p in plans if p.name != "auto"]
    best = min(baselines, key=lambda n: med[n])
    ratio = ratio_per_round(meas, best, "auto", qualified["rounds_used"])
    sched = [p for p in plans if hasattr(p, "workers")]
    seq = next(p for p in sched if p.name == "sequential")
    bound = work_bound(med["sequential"], statistics.fmean(meas["sequential"]["process_cores"]) or 1.0, rt.devices,
                       {"sequential": med["sequential"]})
    span = measured_span_bound(rt, sched, meas, digests, seq, med[best], bound["floor_ms"] / 1e3)
    target_met = bool(qualified["quotable"] and ratio["median"] is not None and ratio["median"] >= TARGET)
    return {
        "question": "training frames/s of scheduler.plan auto on the vision workflow vs the best baseline a user would pick",
        "plans": {n: {"frames_per_s": frames_per_iteration / med[n], "median_iteration_s": med[n],
                      "median_iteration_all_rounds_s": meas[n]["median_all_s"], "bit_identical": identical[n],
                      "validated_iterations": len(validation[n]), "round_medians_s": meas[n]["round_medians"]} for n in med},
        "best_baseline": best,
        "auto_over_best_baseline": {"median": ratio["median"], "interval": [ratio.get("min"), ratio.get("max")],
                                    "interval_is": "min..max of the per-round ratios over the rounds used",
                                    "iqr": ratio.get("iqr"), "per_round": ratio["per_round"]},
        "auto_over_sequential": ratio_per_round(meas, "sequential", "auto", qualified["rounds_used"])["median"],
        "auto_plan": {"name": auto.plan.name, "source": auto.source, "text": auto.plan.describe(),
                      "candidates_ms": {k: v * 1e3 for k, v in auto.candidates.items()},
                      "bit_identical": identical["auto"]},
        "stage_split": {n: stage_split(meas[n]["last"]) for n in med},
        "span_bound": span,
        "work_bound": bound,
        "capacity": qualified,
        "target": TARGET,
        "target_met": target_met,
        "dataloader_bit_identical_note": "no: the same batch rows, but each frame's shift comes from a per-sample "
                                         "stream (augment_and_pack seeded by the sample's index), not ours per batch",
        "workload": {**workload, "camera": f"{size.camera}x{size.camera}", "cameras": list(spec.layout.keys),
                     "obs_dim": spec.layout.dim, "batch_size": spec.batch_size,
                     "steps_per_iteration": spec.steps_per_iteration, "frames_per_iteration": frames_per_iteration,
                     "validation_robots": len(spec.validation.robot_ids) if spec.validation else 0,
                     "learner_threads": spec.learner_threads, "policy": spec.policy.model_dump(mode="json"),
                     "rounds": size.rounds, "iterations_per_run": size.iterations},
        "commit": _commit(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_default_threads": TORCH_DEFAULT_THREADS, "load_start": load_start, "load_end": load()},
        "seconds": time.time() - started,
    }


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Frames/s per plan (left) and each plan's stage split, ms per iteration (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["plans"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["tab:green" if n == "auto" else "tab:red" if n == summary["best_baseline"] else "tab:blue" for n in names]
    left.barh(names, [summary["plans"][n]["frames_per_s"] for n in names], color=colors)
    left.set_xlabel("training frames/s (median, rounds used)")
    left.invert_yaxis()
    ops = sorted({op for n in names for op in summary["stage_split"][n]})
    acc = np.zeros(len(names))
    for k, op in enumerate(ops):
        vals = np.array([summary["stage_split"][n].get(op, 0.0) for n in names])
        right.barh(names, vals, left=acc, label=op, color=plt.cm.tab10(k))
        acc += vals
    right.scatter([summary["plans"][n]["median_iteration_s"] * 1e3 for n in names], names, color="k", marker="|",
                  s=200, label="iteration (wall)", zorder=3)
    right.set_xlabel("ms per iteration in each stage (overlapping stages both count)")
    right.invert_yaxis()
    right.legend(fontsize=7)
    r = summary["auto_over_best_baseline"]
    w = summary["workload"]
    fig.suptitle(f"vision train workflow, {w['camera']} x2 cameras, batch {w['batch_size']} x {w['steps_per_iteration']} "
                 f"steps: auto / best baseline ({summary['best_baseline']}) = {r['median']:.2f}x "
                 f"[{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]; {summary['capacity']['figures_from']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- entry point
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="16x16 cameras, batch 16: code path only")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--steps", type=int, help="optimizer steps per iteration (train.steps_per_iteration)")
    ap.add_argument("--iterations", type=int, help="measured iterations per run (plus one warm-up)")
    ap.add_argument("--camera", type=int, help="camera width = height, pixels")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def study_size(args: argparse.Namespace) -> Size:
    size = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    update = {k: v for k, v in (("rounds", args.rounds), ("steps_per_iteration", args.steps), ("camera", args.camera),
                                ("iterations", args.iterations)) if v is not None}
    return Size(**{**size.__dict__, **update})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from components.training.trainer import make_trainer

    args = parse_args(argv)
    size = study_size(args)
    started, load_start = time.time(), load()
    log(f"vision train workflow: {size} (load {load_start['loadavg_1m']:.2f})")
    with tempfile.TemporaryDirectory() as tmp:
        settings = camera_settings(load_settings(), size, Path(tmp))
        data, workload = camera_training_set(settings, size)
        log(f"camera training set: {workload}")
        trainer = make_trainer(settings, data, log=log)
        auto, plans, loaders = build_rows(trainer, size)
        meas, qualified = measure(trainer, size, plans, loaders)
        summary = report(trainer, size, auto, plans, meas, qualified, workload, started, load_start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=2, default=str))
    plot(summary, args.out / f"{args.name}.png")
    r = summary["auto_over_best_baseline"]
    log(f"auto ({auto.plan.name}) / best baseline ({summary['best_baseline']}): {r['median']:.2f}x "
        f"[{r['interval'][0]:.2f}, {r['interval'][1]:.2f}] over {len(qualified['rounds_used'])} rounds "
        f"({qualified['figures_from']}); target {TARGET}x met: {summary['target_met']}")
    for n, p in summary["plans"].items():
        log(f"  {n:<22} {p['frames_per_s']:8.1f} frames/s  {p['median_iteration_s'] * 1e3:8.1f} ms/iteration  "
            f"bit-identical {p['bit_identical']}  stages {summary['stage_split'][n]}")
    log(f"wrote {args.out / args.name}.json + .png in {summary['seconds']:.0f} s")
    return summary


if __name__ == "__main__":
    main()
