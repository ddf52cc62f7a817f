"""What a run leaves in the Prefect UI: summary markdown, failure tables, learning curve, progress."""

from __future__ import annotations

import base64
import io

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact

from components.evaluation.heldout import EvaluationReport
from components.fert.explorer import Explanation
from components.pipeline.promote import PromotionOutcome
from components.pipeline.references import IngestSummary
from components.pipeline.steps import TrainingSummary


class ProgressArtifact:
    """A progress bar in the Prefect UI, updated as a long task advances."""

    def __init__(self, key: str, description: str) -> None:
        self.id = create_progress_artifact(progress=0.0, key=key, description=description)
        self.last = 0.0

    def update(self, done: int, total: int) -> None:
        pct = 100.0 * done / max(1, total)
        if pct - self.last >= 5.0 or done >= total:  # at most ~20 updates
            update_progress_artifact(self.id, progress=pct)
            self.last = pct


def learning_curve_png(losses: list[float]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 3), dpi=100)
    ax.plot(losses, lw=0.6, alpha=0.4, label="per step")
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(np.arange(len(smooth)) + window - 1, smooth, lw=1.6, label=f"mean of {window}")
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def retrain_summary(
    ingest: IngestSummary | None, report: EvaluationReport, promotion: PromotionOutcome, mlflow_run_url: str, losses: list[float],
    training: TrainingSummary | None = None, step_seconds: dict[str, float] | None = None,
) -> None:
    cand = promotion.candidate
    png = base64.b64encode(learning_curve_png(losses)).decode() if losses else ""
    lines = [
        "# fleetloop retrain",
        "",
        "| | |",
        "|---|---|",
        f"| held-out success (Wilson {100 * report.overall.confidence:.0f}% CI) | **{report.overall}** |",
        f"| candidate | version {cand.version} — [MLflow run]({mlflow_run_url}) |",
        f"| champion before → after | {promotion.champion_before} → {promotion.champion_after} |",
        f"| gate | {promotion.decision.reason} |",
    ]
    if ingest is not None:  # None: a retrain on what is stored (no new files)
        lines += [f"| dataset snapshot (DVC) | `{ingest.snapshot or '-'}` |",
                  f"| LanceDB table version | {ingest.store_version} |", f"| ingest | {ingest.text} |"]
    if step_seconds:  # wall time per step of this retrain, subflow overheads included
        lines.append("| seconds per step | " + ", ".join(f"{k} {v:.1f}" for k, v in step_seconds.items()) + " |")
    if promotion.champion_eval:
        lines.append(f"| champion on the same trials | {100 * promotion.champion_eval['success_rate']:.1f}% |")
    if training is not None:
        lines += ["", *training_markdown(training)]
    if png:
        lines += ["", "## Learning curve", "", f"![training loss](data:image/png;base64,{png})"]
    create_markdown_artifact("\n".join(lines), key="retrain-summary", description="retrain: result, champion, lineage")


def training_markdown(summary: TrainingSummary) -> list[str]:
    """How the candidate was trained: method, retrieval, the scheduler's plan and where time went."""
    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{1e3 * x:.1f} ms"

    fert = summary.fert
    lines = [
        "| training | |", "|---|---|",
        f"| method | `{summary.method}` ({fert.get('frames', 0)} frames from {fert.get('episodes', 0)} successful episodes) |",
        f"| FERT retrieval | {fert.get('queries', 0)} failure queries → {summary.retrieved_segments} retrieved segments "
        f"from {fert.get('matched_robots', 0)} robots |",
        f"| plan | `{summary.plan_name}` (scheduler.plan: {summary.plan_requested}, {summary.plan_source}) |",
        f"| iteration time | {ms(summary.median_iteration_s)} measured, {ms(summary.predicted_iteration_s)} predicted, "
        f"sequential {ms(summary.sequential_iteration_s)} |",
        f"| speed-up over sequential | {'n/a' if summary.speedup_vs_sequential is None else f'{summary.speedup_vs_sequential:.2f}x'} |",
        "| time per stage (s) | " + ", ".join(f"{k} {v:.2f}" for k, v in summary.stage_seconds.items()) + " |",
    ]
    if summary.validation:
        lines.append("| validation success by iteration | " + " ".join(f"{100 * v:.0f}%" for v in summary.validation) + " |")
    usage = summary.expert_usage
    if usage is not None:  # MoE: per-step series and expert_usage.png are on the MLflow run
        lines.append(f"| expert token share (run mean, uniform {100 / usage['experts']:.1f}%) | "
                     + " ".join(f"{100 * s:.1f}%" for s in usage["mean_share"])
                     + f" · dropped {100 * usage['mean_dropped_rate']:.2f}% of pairs |")
    return lines


def training_summary(summary: TrainingSummary) -> None:
    create_markdown_artifact("\n".join(["# fleetloop train", "", *training_markdown(summary), "",
                                         "```", summary.plan_text, "```"]),
                             key="train-summary", description="train: method, plan, time split")


def failure_tables(report: EvaluationReport) -> None:
    create_table_artifact(
        [
            {"robot": robot, "successes": p.successes, "trials": p.trials, "success_rate": round(p.rate, 4), "ci_low": round(p.low, 4), "ci_high": round(p.high, 4)}
            for robot, p in report.by_robot.items()
        ],
        key="heldout-by-robot",
        description="held-out success by robot",
    )
    create_table_artifact(
        [{"stage": stage, "failures": count} for stage, count in sorted(report.failures_by_stage.items())] or [{"stage": "-", "failures": 0}],
        key="failures-by-stage",
        description="held-out failures by the stage where they ended",
    )


def _trials(trials: int | None) -> str:
    return "-" if trials is None else f"{trials} evaluation trials"


def explanation(explained: Explanation, mlflow_run_url: str) -> None:
    """The failure explorer's stage table, with where its pictures are (the run's explain/ folder)."""
    table = explained.stage_table

    def pct(rate: float | None) -> str:
        return "-" if rate is None else f"{100 * rate:.1f}%"

    lines = [
        "# fleetloop failure explorer", "",
        f"{explained.failures} failure contexts of this round, {explained.matches} retrieved success windows kept "
        f"(`{explained.method}`). Pictures: {len(explained.pages)} pages under `explain/` of the "
        f"[MLflow run]({mlflow_run_url}), and in `{explained.out_dir}` (`fleetloop explain VERSION` writes the same).", "",
        (f"| stage | failed in the fleet's data ({table.before_episodes} episodes) | of which queried | "
         f"champion before ({_trials(table.champion_trials)}) | candidate after ({_trials(table.after_trials)}) |"),
        "|---|---|---|---|---|",
    ]

    def cell(failures: int | None, rate: float | None) -> str:
        return "-" if failures is None else f"{failures} ({pct(rate)})"

    for row in table.rows:
        lines.append(f"| {row.stage} | {cell(row.before_failures, row.before_rate)} | {row.queried_failures} | "
                     f"{cell(row.champion_failures, row.champion_rate)} | {cell(row.after_failures, row.after_rate)} |")
    if explained.robots_left_out:
        lines += ["", f"Robots without a page (explain.max_robot_pages): {', '.join(explained.robots_left_out)}"]
    create_markdown_artifact("\n".join(lines), key="failure-explorer",
                             description="failures by stage before/after the round; where the pictures are")
