"""Remote stores vs the local root: the ingest and retrain flows' wall time, side by side.

    python -m benchmarks.remote_stores              # 3 rounds
    python -m benchmarks.remote_stores --quick      # 1 round, fewer demos
    python -m benchmarks.run_all --remote           # the same, from make bench's runner

Every round runs the product's own flows twice on the same expert demos (collected once per round,
untimed), once per mode, the order alternating between rounds:
- **local**: a fresh root, every store under it (SQLite MLflow, LanceDB folder, DVC cache);
- **remote**: a fresh root with the team deployment of docs/deploy.md on loopback, started here
  by ``tests/servers.py`` as the tests start it: an MLflow tracking server on Postgres with
  artifacts on S3 (moto), the segment store on that S3 (``store.uri``) and the DVC snapshots
  pushed to a DVC remote on it. Each round gets its own model name, experiment, store prefix and
  DVC remote, so both modes start from nothing (no champion: the same gate).
Timed: ``flows.ingest.ingest`` of the demos, then ``flows.retrain.retrain`` on what is stored
(train → evaluate → register → gate), split by subflow from the Prefect server's record. Both
modes run under one temporary Prefect server. The figure is the remote/local ratio per round
(paired), and its median.

Writes benchmarks/results/remote_stores.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from components.config import Settings, load_settings

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "remote_stores"
MODES = ("local", "remote")


@dataclass(frozen=True)
class Plan:
    rounds: int
    expert_robots: int
    episodes_per_robot: int
    epochs: int


FULL = Plan(rounds=3, expert_robots=4, episodes_per_robot=10, epochs=5)
QUICK = Plan(rounds=1, expert_robots=2, episodes_per_robot=6, epochs=2)


@dataclass
class Servers:
    """Postgres, S3 and an MLflow tracking server on 127.0.0.1 (tests/servers.py)."""

    postgres: object
    s3: object
    mlflow: object
    folder: Path

    @classmethod
    def start(cls) -> Servers:
        from tests.servers import (
            ARTIFACT_BUCKET,
            start_mlflow_server,
            start_postgres,
            start_s3,
        )

        folder = Path(tempfile.mkdtemp(prefix="fleetloop-remote-bench-"))
        postgres, s3 = start_postgres(), start_s3()
        s3.create_bucket(ARTIFACT_BUCKET)
        mlflow = start_mlflow_server(postgres.create_database("mlflow"), f"s3://{ARTIFACT_BUCKET}/proxied", s3.env, folder)
        return cls(postgres, s3, mlflow, folder)

    def stop(self) -> None:
        for server in (self.mlflow, self.s3, self.postgres):
            server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def base_settings(plan: Plan, root: Path) -> Settings:
    s = load_settings(root=root)
    return s.model_copy(update={
        "demo": s.demo.model_copy(update={"expert_robots": plan.expert_robots,
                                          "expert_episodes_per_robot": plan.episodes_per_robot}),
        "train": s.train.model_copy(update={"epochs": plan.epochs}),
    })


def remote_settings(settings: Settings, servers: Servers, tag: str) -> Settings:
    """``settings`` pointed at the servers, with this round's own names (nothing shared between rounds)."""
    from tests.servers import ARTIFACT_BUCKET, ARTIFACT_PREFIX

    bucket = f"s3://{ARTIFACT_BUCKET}"
    return settings.model_copy(update={
        "registry": settings.registry.model_copy(update={
            "tracking_uri": servers.mlflow.url, "artifact_uri": f"{bucket}/{ARTIFACT_PREFIX}-{tag}",
            "experiment": f"fleetloop-{tag}", "model_name": f"fleetloop-policy-{tag}"}),
        "store": settings.store.model_copy(update={"uri": f"{bucket}/segments-{tag}"}),
        "episodes": settings.episodes.model_copy(update={"dvc_remote": f"{bucket}/dvc-{tag}",
                                                          "dvc_remote_endpoint": servers.s3.endpoint}),
    })


SUBFLOWS = ("train", "evaluate", "promote")  # the retrain flow's parts after its (empty) ingest


def subflow_seconds(since: datetime) -> dict[str, float]:
    """Run time of each retrain subflow that started after ``since``, from the Prefect server's record."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)))
        names = {flow_id: client.read_flow(flow_id).name for flow_id in {r.flow_id for r in runs}}
    return {f"{name}_s": sum(r.total_run_time.total_seconds() for r in runs if names[r.flow_id] == name)
            for name in SUBFLOWS}


def run_mode(settings: Settings, files: list[Path]) -> dict:
    """The ingest flow on ``files``, then the retrain flow on what is stored; seconds of each, and of
    the retrain's subflows (train reads the segment store only for FERT's retrieval; evaluate reads
    no store; promote registers and gates through the registry)."""
    from flows.ingest import ingest
    from flows.retrain import retrain
    from flows.runtime import task_runner

    start = time.perf_counter()
    ingested = ingest.with_options(task_runner=task_runner(settings))(files, settings)
    middle, since = time.perf_counter(), datetime.now(UTC)
    promotion = retrain([], f"bench-{settings.root.name}", settings)
    end = time.perf_counter()
    return {"ingest_s": middle - start, "retrain_s": end - middle, "total_s": end - start, **subflow_seconds(since),
            "episodes": len(ingested.report.added), "version": promotion.candidate.version,
            "success_rate": promotion.candidate.successes / max(1, promotion.candidate.trials)}


def run(plan: Plan, workdir: Path) -> dict:
    from prefect.testing.utilities import prefect_test_harness

    from components.pipeline.collect import collect_expert_demos

    servers = Servers.start()
    os.environ.update(servers.s3.env | {"AWS_ENDPOINT_URL": servers.s3.endpoint})  # keys + endpoint, as docs/deploy.md
    rounds = []
    try:
        with prefect_test_harness(server_startup_timeout=120):
            for r in range(plan.rounds):
                demos = collect_expert_demos(base_settings(plan, workdir / f"demos-{r}"), workdir / f"incoming-{r}")
                order = MODES if r % 2 == 0 else MODES[::-1]
                row = {"round": r, "order": list(order)}
                for mode in order:
                    settings = base_settings(plan, workdir / f"{mode}-{r}")
                    if mode == "remote":
                        settings = remote_settings(settings, servers, f"r{r}-{os.getpid()}")
                    row[mode] = run_mode(settings, demos.files)
                    print(f"round {r + 1}/{plan.rounds} {mode:6s}: ingest {row[mode]['ingest_s']:.1f}s, "
                          f"retrain {row[mode]['retrain_s']:.1f}s", flush=True)
                rounds.append(row)
    finally:
        servers.stop()
    return summarize(rounds)


def summarize(rounds: list[dict]) -> dict:
    out = {"rounds": rounds}
    for phase in ("ingest_s", "retrain_s", "total_s", *(f"{name}_s" for name in SUBFLOWS)):
        ratios = [row["remote"][phase] / row["local"][phase] for row in rounds]
        out[phase.removesuffix("_s")] = {
            "local_median_s": statistics.median(row["local"][phase] for row in rounds),
            "remote_median_s": statistics.median(row["remote"][phase] for row in rounds),
            "overhead_ratio_median": statistics.median(ratios), "overhead_ratio_min": min(ratios),
            "overhead_ratio_max": max(ratios), "overhead_ratio_per_round": ratios,
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ("ingest", "retrain", "total")
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, mode in enumerate(MODES):
        xs = [i + (k - 0.5) * width for i in range(len(phases))]
        ax.bar(xs, [result[p][f"{mode}_median_s"] for p in phases], width, label=f"{mode} (median)")
        for i, phase in enumerate(phases):
            ax.scatter([xs[i]] * len(result["rounds"]), [row[mode][f"{phase}_s"] for row in result["rounds"]],
                       color="black", s=10, zorder=3)
    for i, phase in enumerate(phases):
        ax.annotate(f"x{result[phase]['overhead_ratio_median']:.2f}", (i, result[phase]["remote_median_s"]),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(phases)), [f"{p} flow" if p != "total" else "ingest + retrain" for p in phases])
    ax.set_ylabel("seconds (dots: rounds)")
    ax.set_title("remote stores on loopback (Postgres + MLflow server + S3) vs the local root", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, fewer demos and epochs")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: 3, --quick: 1)")
    parser.add_argument("--name", default=NAME, help="results file name under benchmarks/results")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = Plan(args.rounds, plan.expert_robots, plan.episodes_per_robot, plan.epochs)
    started = time.perf_counter()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fleetloop-remote-") as tmp:
        result = run(plan, Path(tmp))
    result = {"benchmark": NAME, "plan": asdict(plan),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
              **result, "wall_s": time.perf_counter() - started}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{args.name}.png")
    for phase in ("ingest", "retrain", *SUBFLOWS, "total"):
        f = result[phase]
        print(f"{phase:8s} local {f['local_median_s']:.1f}s  remote {f['remote_median_s']:.1f}s  "
              f"remote/local x{f['overhead_ratio_median']:.2f} [{f['overhead_ratio_min']:.2f}, {f['overhead_ratio_max']:.2f}]")
    print(f"wrote {RESULTS / args.name}.json and .png")


if __name__ == "__main__":
    main()
