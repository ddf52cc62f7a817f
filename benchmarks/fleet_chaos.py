"""FATS chaos at fleet scale: the real fleet runtime under a seeded fault schedule, then an audit.

The fleet is started as `fleetloop fleet up` starts it (coordinator -> ingest, inference, trainer,
one robot agent process per robot; robots reach the services through two loopback fault proxies)
on a bootstrap root: expert demonstrations in the dataset and an untrained champion, so the
trainer has something to beat. For ``--minutes`` a seeded schedule (components/fleet/chaos.py)
SIGKILLs robots, inference, ingest, the trainer and the coordinator (restarted as `fleet up`
would), drops / delays / resets connections, fills the dataset's disk below its reserve, makes
the ingest's writes fail (EFBIG), and revokes and re-issues a robot's token. Then every fault is
healed, the fleet drains (robots upload their spools), and the dataset is audited against every
robot's ledger.

    python -m benchmarks.fleet_chaos                          # 96 robots, 10 minutes of faults
    python -m benchmarks.fleet_chaos --robots 48 --minutes 12 --seed 3
    python -m benchmarks.fleet_chaos --quick                  # 4 robots, ~40 s of faults

Writes benchmarks/results/fleet_chaos.json (+ _quick) and fleet_chaos.png: stored episodes over
time, every fault as a marker, the champion version. Targets: lost = duplicated = corrupted = 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from components.config import (
    DemoConfig,
    EvaluationConfig,
    FleetConfig,
    Settings,
    SimConfig,
)
from components.fleet.chaos import (
    FAULT_KINDS,
    ChaosPlan,
    ChaosReport,
    chaos_settings,
    run_chaos,
)

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "fleet_chaos"


@dataclass(frozen=True)
class BenchmarkSize:
    """Everything the fleet's size changes. Per-robot knobs scale so that 96 interpreters on two
    cores are not killed for being slow to start or to beat (that would measure the host)."""

    robots: int
    minutes: float
    seed: int = 0
    quick: bool = False

    @property
    def max_steps(self) -> int:
        return 30 if self.quick else 40

    @property
    def runtime(self) -> dict:
        big = self.robots > 16
        ship = {"candidate_every_steps": 0, "candidate_every_s": 0.0} if self.quick else {
            "candidate_every_steps": 400, "candidate_every_s": 120.0, "candidate_retry_s": 30.0,
        }
        return dict(
            # the trainer trains train.method (FERT, the product default) on the expert seed data and
            # the fleet's episodes; the quick run ships nothing
            heartbeat_s=1.0 if big else 0.25,
            lease_s=20.0 if big else 4.0,
            startup_grace_s=max(90.0, 3.0 * self.robots),  # 99 interpreters start at once after a coordinator kill
            inference_timeout_s=5.0 if big else 1.0,
            upload_timeout_s=30.0 if big else 10.0,
            stop_grace_s=5.0 if big else 3.0,
            **ship,
        )

    def plan(self) -> ChaosPlan:
        window = 8.0 if self.quick else 20.0
        timeout = self.runtime["inference_timeout_s"]
        return ChaosPlan(
            robots=self.robots, duration_s=self.minutes * 60.0, kinds=FAULT_KINDS,
            extra_robot_kills=1 if self.quick else 3,
            min_gap_s=1.0 if self.quick else 8.0, max_gap_s=2.5 if self.quick else 20.0,
            window_s=window, net_delay_s=0.6 * timeout,  # a request is two chunks: past the timeout
            disk_headroom_bytes=(256 if self.quick else 2048) * 1024**2, sample_s=2.0,
            seed=self.seed, timeout_s=300.0 if self.quick else 900.0,
        )


def benchmark_settings(root: Path, size: BenchmarkSize) -> Settings:
    """params.yaml's settings for a scratch root, with a small evaluation (each candidate is
    judged on held-out trials while the fleet runs on the same two cores)."""
    base = Settings(root=root)
    overrides = dict(
        seed=size.seed,
        sim=SimConfig(**{**base.sim.model_dump(), "max_steps": size.max_steps, "motion_noise_std": 0.0}),
        fleet=FleetConfig(**{**base.fleet.model_dump(), "num_robots": size.robots, "num_heldout_robots": 4}),
        evaluation=EvaluationConfig(**{**base.evaluation.model_dump(), "trials_per_task": 48, "trials_per_robot": 12}),
        demo=DemoConfig(expert_robots=4, expert_episodes_per_robot=4 if size.quick else 10, rounds=1),
    )
    return base.model_copy(update=overrides)


def seed_root(settings: Settings) -> int:
    """The bootstrap root: the scripted expert's episodes in the dataset (what `make demo` starts from)."""
    from components.episodes.dataset import EpisodeDataset
    from components.pipeline.collect import EXPERT_VERSION
    from components.sim.collect import run_episodes
    from components.sim.factory import make_expert

    robots = settings.fleet.robot_ids(settings.demo.expert_robots)
    episodes = run_episodes(
        make_expert(settings.sim), robots, settings.sim, settings.demo.expert_episodes_per_robot,
        seed=settings.seed, policy_version=EXPERT_VERSION,
    )
    EpisodeDataset(settings.paths.episodes, settings.episodes).add_episodes(episodes)
    return len(episodes)


def run_benchmark(root: Path, size: BenchmarkSize, progress=print) -> ChaosReport:
    """Seed the root, run the chaos plan on the real runtime, audit (components/fleet/chaos.py)."""
    settings = benchmark_settings(root, size)
    plan = size.plan()
    progress(f"seeded {seed_root(settings)} expert episodes; {size.robots} robots, {plan.duration_s:.0f}s of faults, seed {size.seed}")
    return run_chaos(chaos_settings(settings, plan, **size.runtime), plan, progress)


def summary(report: ChaosReport, size: BenchmarkSize) -> dict:
    """The figures issue 20 asks for, first; the whole report after."""
    return {
        "robots": size.robots, "minutes": size.minutes, "seed": size.seed, "quick": size.quick,
        "episodes": {k: getattr(report, k) for k in ("finished", "stored", "lost", "duplicated", "corrupted", "interrupted", "stored_before")},
        "faults_by_kind": report.faults_by_kind, "faults": len(report.faults), "skipped": report.skipped,
        "latency_episode_end_to_stored_s": report.latency_s,
        "promotions": report.promotions, "champion_versions": report.champion_versions,
        "restarts_total": report.restarts_total, "max_member_restarts_per_min": report.max_member_restarts_per_min,
        "max_fleet_restarts_per_min": report.max_fleet_restarts_per_min,
        "completed": report.completed, "leaked_pids": report.leaked_pids, "outlived_coordinator": report.outlived_coordinator,
        "seconds": report.seconds,
        "trainer": {"method": report.trainer_method, "pin": report.trainer_pin, "steps": report.trainer_steps,
                    "resumes": report.trainer_resumes},
        "report": asdict(report),
    }


def plot(report: ChaosReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p.t_s / 60 for p in report.timeline]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot(t, [p.stored for p in report.timeline], label="stored (robots' acks)", color="tab:blue")
    top.plot(t, [p.finished for p in report.timeline], label="finished", color="tab:gray", ls="--", lw=1)
    kinds = sorted({f.kind for f in report.faults})
    colors = plt.get_cmap("tab20")(range(len(kinds)))
    ymax = max([p.finished for p in report.timeline] + [1])
    for kind, color in zip(kinds, colors):
        at = [f.at_s / 60 for f in report.faults if f.kind == kind]
        top.scatter(at, [ymax * 1.04] * len(at), marker="v", color=color, label=kind, s=28, zorder=3)
        for x in at:
            top.axvline(x, color=color, alpha=0.18, lw=1)
    top.set_ylabel("episodes")
    top.set_title(
        f"FATS chaos: {report.robots} robots, {len(report.faults)} faults; finished {report.finished}, "
        f"lost {report.lost}, duplicated {report.duplicated}, corrupted {report.corrupted}"
    )
    top.legend(fontsize=7, ncol=4, loc="upper left")
    bottom.step(t, [p.champion if p.champion is not None else float("nan") for p in report.timeline], where="post", color="tab:green")
    bottom.set_ylabel("champion v")
    bottom.set_xlabel("minutes since the fleet came up")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(report: ChaosReport, size: BenchmarkSize, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = NAME + ("_quick" if size.quick else "")
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    json_path.write_text(json.dumps(summary(report, size), indent=2))
    plot(report, png_path)
    return json_path, png_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", type=int, default=None, help="fleet size (default 96; 4 with --quick)")
    parser.add_argument("--minutes", type=float, default=None, help="fault phase (default 10; 0.67 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and the fleet")
    parser.add_argument("--quick", action="store_true", help="smoke size")
    parser.add_argument("--root", type=Path, default=None, help="root to run in (default: a scratch folder)")
    args = parser.parse_args()
    size = BenchmarkSize(
        robots=args.robots or (4 if args.quick else 96), minutes=args.minutes or (0.67 if args.quick else 10.0),
        seed=args.seed, quick=args.quick,
    )
    root = args.root or Path(tempfile.mkdtemp(prefix="fleetloop-chaos-bench-"))
    started = time.monotonic()
    report = run_benchmark(root, size, progress=lambda line: print(f"[{time.monotonic() - started:7.1f}s] {line}", flush=True))
    json_path, png_path = write_results(report, size)
    figures = summary(report, size)
    print(json.dumps({k: v for k, v in figures.items() if k != "report"}, indent=2))
    print(f"wrote {json_path} and {png_path} (root {root})")
    ok = report.completed and (report.lost, report.duplicated, report.corrupted) == (0, 0, 0) and not report.leaked_pids
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
