"""The dvc.yaml stages (collect → ingest → train → evaluate), run by ``fleetloop stage NAME``.

They call the same step functions as the Prefect flows, under a separate root ``<root>/build``
so ``dvc repro`` never touches the live dataset or registry. DVC itself versions the outputs
(dvc.lock holds their hashes), so the ingest stage takes no extra snapshot.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import torch

from components.config import Settings
from components.pipeline import collect, evaluate, ingest, steps
from components.policy.factory import make_policy
from components.policy.observation import configured_layout
from components.training.checkpoint import state_digest

BUILD_DIR = "build"


def _build_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"root": settings.root / BUILD_DIR})


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def stage_collect(settings: Settings) -> None:
    build = _build_settings(settings)
    result = collect.collect_expert_demos(build, build.paths.incoming)
    print(f"collect: {result.episodes} expert episodes, {100 * result.success_rate:.1f}% success")


def stage_ingest(settings: Settings) -> None:
    build = _build_settings(settings)
    files = sorted(build.paths.incoming.glob("*.parquet"))
    result = ingest.ingest_files(build, files, snapshot=False)
    print(f"ingest: {len(result.report.added)} episodes, {result.segments_upserted} segments")


def stage_train(settings: Settings) -> None:
    """The flow's train step (``steps.train_policy``, or PPO for ``train.workload: ppo``) on the build root."""
    build = _build_settings(settings)
    if build.train.workload == "ppo":
        from components.pipeline.scheduled import train_scheduled

        outcome: steps.TrainOutcome = train_scheduled(build, log=print)
    else:
        outcome = steps.train_policy(build, log=print)
    result = outcome.result
    model_dir = build.root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.save(result.policy.state_dict(), model_dir / "policy.pt")
    metrics = settings.paths.metrics
    summary = outcome.summary
    _write_json(metrics / "train.json", {
        "final_loss": result.final_loss, "frames": outcome.frames, "steps": result.steps,
        "method": build.train.method if build.train.workload == "imitation" else build.train.workload,
        "plan": summary.plan_name if summary else None, "weights_digest": state_digest(result.policy.state_dict()),
    })
    with (metrics / "loss.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        every = max(1, len(result.losses) // 200)
        writer.writerows([i, f"{loss:.6f}"] for i, loss in enumerate(result.losses) if i % every == 0)
    print(f"train: {outcome.frames} frames, {result.steps} steps, plan {summary.plan_name if summary else '-'}")


def stage_evaluate(settings: Settings) -> None:
    build = _build_settings(settings)
    ws = steps.Workspace(build)
    policy = make_policy(ws.obs_dim, ws.act_dim, build.policy, configured_layout(ws.obs_dim, build.policy, build.sim))
    policy.load_state_dict(torch.load(build.root / "model" / "policy.pt", weights_only=True))
    report = evaluate.evaluate_policy(build, policy, "dvc-repro")
    metrics = settings.paths.metrics
    _write_json(metrics / "eval.json", {
        "success_rate": report.overall.rate, "ci_low": report.overall.low, "ci_high": report.overall.high,
        "trials": report.overall.trials, "failures_by_stage": report.failures_by_stage,
    })
    with (metrics / "eval_by_robot.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["robot", "success_rate"])
        writer.writerows([robot, f"{p.rate:.4f}"] for robot, p in report.by_robot.items())
    print(f"evaluate: held-out success {report.overall}")


STAGES: dict[str, Callable[[Settings], None]] = {
    "collect": stage_collect,
    "ingest": stage_ingest,
    "train": stage_train,
    "evaluate": stage_evaluate,
}


def run_stage(name: str, settings: Settings) -> None:
    STAGES[name](settings)
