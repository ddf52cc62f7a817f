"""The failure explorer: what one FERT round learned from, as pictures and a stage table.

    RetrievalRecord (what the trainer's FERT path used: failures, divergence steps, kept matches)
    + the episodes of the dataset the round trained on + the candidate's evaluation (optional)
      --explain()-->  by-robot/<robot>.png, by-stage/<i>-<stage>.png: one row per failure: its
                      trajectory top-down in the workspace (context from the divergence on in red, the
                      divergence point an X), then its nearest distinct retrieved success windows
                      (matched frames in green, the failure's query window dashed over them)
                      stage_failures.{csv,json,png}: failures by stage in the fleet's episodes the
                      round trained on, and like for like on the same evaluation trials: the champion
                      before the round (the gate's paired evaluation) and the candidate after it
                      frames/<group>-<page>-<failure>.png (when the episodes have camera streams): the
                      failure's camera frames from its divergence on (red bar) above the frames of
                      the success windows it retrieved (green bars), one row each, every view; the
                      same strip is the last panel of the failure's row on the page
                      index.json: every file, what each page shows and what it left out

Nothing is retrieved again here: the pictures show exactly the matches the trainer weighted.
A failure's stage is the furthest stage it reached (``evaluation.heldout.stage_name``, the same
rule as the evaluation's failures by stage). Same inputs, same bytes (Agg, no PNG timestamps).
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from components.config import ExplainConfig
from components.episodes.record import STAGE_COLUMN, Episode
from components.evaluation.heldout import stage_name
from components.fert.methods import DEMO_VERSION
from components.fert.retrieval_record import FailureRecord, MatchRecord, RetrievalRecord
from components.sim.factory import WorkspaceView

PNG_METADATA = {"Software": None}  # no version string: the same inputs give the same bytes
PANEL_INCHES = 2.3
FAILURE_COLOR, MATCH_COLOR, PATH_COLOR = "tab:red", "tab:green", "0.6"
BODY_STYLES = ("-", ":", "--", "-.")  # end effector, then the other moving bodies
# camera thumbnails: frames of a window shown (evenly spaced, first and last), the white gap between
# tiles and the colored bar left of each row (red: the failure, green: a retrieved success), in pixels
THUMB_FRAMES, THUMB_GAP, THUMB_BAR = 4, 2, 4
BAR_RGB = {FAILURE_COLOR: (214, 39, 40), MATCH_COLOR: (44, 160, 44)}

CameraFrames = Callable[[str], Mapping[str, np.ndarray]]  # episode id -> camera key -> (T, H, W, 3) uint8


# -- the stage table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StageCounts:
    """Failed episodes by the stage they reached, out of ``episodes`` episodes."""

    failures: dict[str, int]
    episodes: int

    @classmethod
    def of(cls, episodes: Sequence[Episode], stages: tuple[str, ...]) -> StageCounts:
        return cls(dict(Counter(stage_name(ep, stages) for ep in episodes if not ep.success)), len(episodes))

    def rate(self, stage: str) -> float | None:
        return self.failures.get(stage, 0) / self.episodes if self.episodes else None


@dataclass(frozen=True)
class StageRow:
    stage: str
    before_failures: int
    before_rate: float | None  # share of the fleet's episodes (training data) that failed at this stage
    queried_failures: int  # of those, the failures whose contexts queried the store this round
    after_failures: int | None  # the candidate's evaluation rollouts; None when not evaluated
    after_rate: float | None
    # the champion the round started from, on the candidate's evaluation trials (the gate's paired
    # evaluation); None when there was no champion or its evaluation was not kept with the version
    champion_failures: int | None = None
    champion_rate: float | None = None


@dataclass(frozen=True)
class StageTable:
    rows: tuple[StageRow, ...]
    before_episodes: int  # the fleet's episodes in the training data (expert demos left out)
    after_trials: int | None
    champion_trials: int | None = None

    def to_dict(self) -> dict:
        return {"before_episodes": self.before_episodes, "after_trials": self.after_trials,
                "champion_trials": self.champion_trials, "rows": [asdict(r) for r in self.rows]}


def stage_table(
    training_episodes: Sequence[Episode], record: RetrievalRecord, stages: tuple[str, ...], after: StageCounts | None,
    champion: StageCounts | None = None,
) -> StageTable:
    """Failures by stage in the fleet's rollouts the round trained on (expert demos are no policy's
    rollouts), and on the evaluation trials: the candidate after the round (``after``) and the
    champion before it on the same trials (``champion``), when given."""
    fleet = [ep for ep in training_episodes if ep.policy_version != DEMO_VERSION]
    before = StageCounts.of(fleet, stages)
    by_id = {ep.episode_id: ep for ep in training_episodes}
    queried = Counter(stage_name(by_id[f.episode_id], stages) for f in record.failures)
    evaluated = [c for c in (after, champion) if c is not None]
    seen = set(before.failures) | set(queried) | {s for c in evaluated for s in c.failures}
    names = list(stages) + sorted(seen - set(stages))  # every stage of the task, then e.g. unknown

    def count(c: StageCounts | None, s: str) -> tuple[int | None, float | None]:
        return (None, None) if c is None else (c.failures.get(s, 0), c.rate(s))

    rows = tuple(
        StageRow(s, before.failures.get(s, 0), before.rate(s), queried.get(s, 0), *count(after, s), *count(champion, s))
        for s in names
    )
    return StageTable(rows, before.episodes, None if after is None else after.episodes,
                      None if champion is None else champion.episodes)


def write_stage_table(table: StageTable, out_dir: Path, dpi: int) -> tuple[Path, Path, Path]:
    """``stage_failures.csv``, ``.json`` and a bar chart ``.png`` of failure rates by stage."""
    csv_path, json_path, png_path = (out_dir / f"stage_failures.{ext}" for ext in ("csv", "json", "png"))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(StageRow.__dataclass_fields__))
        writer.writeheader()
        for row in table.rows:
            writer.writerow({k: "" if v is None else v for k, v in asdict(row).items()})
    json_path.write_text(json.dumps(table.to_dict(), indent=2) + "\n")

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(table.rows) + 1.5), 3.2), dpi=dpi, layout="constrained")
    x = np.arange(len(table.rows))
    bars = [("fleet", [r.before_rate for r in table.rows], [r.before_failures for r in table.rows], "tab:gray",
             f"fleet: {table.before_episodes} episodes in the training data")]
    if table.champion_trials is not None:
        bars.append(("before", [r.champion_rate for r in table.rows], [r.champion_failures for r in table.rows],
                     "tab:orange", f"before: champion, the same {table.champion_trials} evaluation trials"))
    if table.after_trials is not None:
        bars.append(("after", [r.after_rate for r in table.rows], [r.after_failures for r in table.rows], "tab:blue",
                     f"after: candidate, {table.after_trials} evaluation trials"))
    width = 0.8 / len(bars)
    for i, (_, rates, counts, color, label) in enumerate(bars):
        heights = [100 * (r or 0.0) for r in rates]
        pos = x + (i - (len(bars) - 1) / 2) * width
        ax.bar(pos, heights, width, color=color, label=label)
        for px, h, n in zip(pos, heights, counts, strict=True):
            ax.annotate(str(n), (px, h), ha="center", va="bottom", fontsize=7)
    top = max([100 * (r or 0.0) for _, rates, *_ in bars for r in rates] + [1.0])
    ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    ax.set_xticks(x, [r.stage for r in table.rows])
    ax.set(ylabel="% of episodes failing here", title="failures by the stage they reached")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(png_path, metadata=PNG_METADATA)
    plt.close(fig)
    return csv_path, json_path, png_path


# -- the pages -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Page:
    path: str
    group: str  # robot | stage
    key: str
    failures_shown: list[str]
    failures_total: int

    @property
    def truncated(self) -> bool:
        return len(self.failures_shown) < self.failures_total


@dataclass(frozen=True)
class Explanation:
    """What ``explain`` wrote (paths relative to ``out_dir``) and the stage table."""

    out_dir: str
    method: str
    failures: int
    matches: int
    pages: list[Page]
    stage_table: StageTable
    files: list[str]  # every file written, relative to out_dir (index.json included)
    robots_left_out: list[str] = field(default_factory=list)  # robots beyond explain.max_robot_pages

    def to_dict(self) -> dict:
        return {"out_dir": self.out_dir, "method": self.method, "failures": self.failures, "matches": self.matches,
                "pages": [{**asdict(p), "truncated": p.truncated} for p in self.pages],
                "stage_table": self.stage_table.to_dict(), "files": list(self.files),
                "robots_left_out": list(self.robots_left_out)}


def nearest_windows(record: RetrievalRecord, failure: str, count: int) -> list[MatchRecord]:
    """The ``count`` nearest *distinct* success segments a failure's windows retrieved (a segment
    found by several of its windows appears once, with its nearest distance)."""
    chosen: dict[tuple[str, int], MatchRecord] = {}
    for match in record.matches_of(failure):  # nearest first
        chosen.setdefault((match.episode_id, match.start), match)
        if len(chosen) == count:
            break
    return list(chosen.values())


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _draw_episode(ax, ep: Episode, view: WorkspaceView, color: str, frames: slice | None = None, lw: float = 0.8,
                  targets: bool = True) -> None:
    """Every body's path (the end effector solid), and the targets where they start."""
    states = ep.states if frames is None else ep.states[frames]
    for (name, cx, cy), style in zip(view.paths, BODY_STYLES, strict=False):
        ax.plot(states[:, cx], states[:, cy], style, color=color, lw=lw if style == "-" else 0.7 * lw)
    if targets:
        for name, cx, cy in view.targets:
            ax.plot(ep.states[0, cx], ep.states[0, cy], "*", color="goldenrod", ms=9, mec="k", mew=0.4)
    hand = view.paths[0]
    ax.plot(ep.states[0, hand[1]], ep.states[0, hand[2]], "o", color="k", ms=3)


def _frame_axes(ax, view: WorkspaceView) -> None:
    if view.bounds is not None:
        ax.set_xlim(*view.bounds)
        ax.set_ylim(*view.bounds)
    ax.set_aspect("equal", adjustable="box")
    ax.set_xticks([])
    ax.set_yticks([])


def _failure_panel(ax, failure: FailureRecord, ep: Episode, stage: str, stages: tuple[str, ...], view: WorkspaceView) -> None:
    _draw_episode(ax, ep, view, PATH_COLOR)
    _draw_episode(ax, ep, view, FAILURE_COLOR, slice(failure.divergence_step, None), lw=1.6, targets=False)
    hand = view.paths[0]
    d = min(failure.divergence_step, ep.length - 1)
    ax.plot(ep.states[d, hand[1]], ep.states[d, hand[2]], "X", color=FAILURE_COLOR, ms=10, mec="k", mew=0.6)
    if failure.fallback:
        where = f"no divergence: last {ep.length - failure.divergence_step} steps"
    else:
        at = ep.extras.get(STAGE_COLUMN)
        during = stages[int(at[d])] if at is not None and np.isfinite(at[d]) and 0 <= int(at[d]) < len(stages) else "?"
        where = f"diverged t={failure.divergence_step} ({during})"
    ax.set_title(f"FAILED {failure.robot_id} {failure.episode_id[:8]}\nends at {stage}; {where}", fontsize=7,
                 color=FAILURE_COLOR)
    _frame_axes(ax, view)


def _match_panel(ax, match: MatchRecord, success: Episode, failed: Episode, window: int, view: WorkspaceView) -> None:
    _draw_episode(ax, success, view, PATH_COLOR)
    _draw_episode(ax, success, view, MATCH_COLOR, slice(match.start, match.end), lw=2.0, targets=False)
    hand = view.paths[0]
    query = failed.states[match.query_start: match.query_start + window]
    ax.plot(query[:, hand[1]], query[:, hand[2]], "--", color=FAILURE_COLOR, lw=1.0)
    ax.set_title(f"success {match.robot_id} {match.episode_id[:8]}\nframes {match.start}-{match.end}, d={match.distance:.3f}",
                 fontsize=7, color="darkgreen")
    _frame_axes(ax, view)


def _window_frames(frames: np.ndarray, start: int, window: int) -> np.ndarray:
    """``THUMB_FRAMES`` evenly spaced frames of [start, start + window) (clipped to the episode)."""
    end = min(len(frames), start + window)
    start = min(max(0, start), end - 1)
    picks = np.unique(np.rint(np.linspace(start, end - 1, min(THUMB_FRAMES, end - start))).astype(np.int64))
    return frames[picks]


def thumbnail_strip(rows: Sequence[tuple[str, Mapping[str, np.ndarray], int]], keys: Sequence[str], window: int) -> np.ndarray:
    """(H, W, 3) uint8: one row per (color, camera frames, first frame) window; per row, for each
    camera key, ``THUMB_FRAMES`` of its frames side by side (white ``THUMB_GAP`` between tiles,
    a ``THUMB_BAR``-wide bar of the row's color on the left). Tiles take the first key's frame size."""
    first = next(frames[k] for _, frames, _ in rows for k in keys if k in frames)
    h, w = first.shape[1:3]
    tile_w, tile_h = w + THUMB_GAP, h + THUMB_GAP
    strip = np.full((THUMB_GAP + len(rows) * tile_h, THUMB_BAR + THUMB_GAP + len(keys) * THUMB_FRAMES * tile_w, 3),
                    255, dtype=np.uint8)
    for r, (color, frames, start) in enumerate(rows):
        y = THUMB_GAP + r * tile_h
        strip[y : y + h, :THUMB_BAR] = BAR_RGB[color]
        for v, key in enumerate(keys):
            if key not in frames:
                continue
            for f, frame in enumerate(_window_frames(frames[key], start, window)):
                x = THUMB_BAR + THUMB_GAP + (v * THUMB_FRAMES + f) * tile_w
                strip[y : y + h, x : x + w] = frame[:h, :w]
    return strip


def _failure_strip(failure: FailureRecord, matches: Sequence[MatchRecord], window: int,
                   frames_of: CameraFrames) -> np.ndarray | None:
    """The thumbnail strip of a failure and its shown matches; None when the failure has no camera frames."""
    mine = frames_of(failure.episode_id)
    keys = sorted(mine)
    if not keys:
        return None
    rows = [(FAILURE_COLOR, mine, failure.divergence_step)]
    rows += [(MATCH_COLOR, frames_of(m.episode_id), m.start) for m in matches]
    return thumbnail_strip(rows, keys, window)


def _strip_panel(ax, strip: np.ndarray, keys: Sequence[str], rows: int) -> None:
    ax.imshow(strip, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    views = ", ".join(k.rsplit(".", 1)[-1] for k in keys)
    ax.set_title(f"camera ({views}): failure from the divergence,\nthen the {rows - 1} windows it retrieved",
                 fontsize=7)


def _page(path: Path, title: str, failures: Sequence[FailureRecord], total: int, episodes: Mapping[str, Episode],
          record: RetrievalRecord, stages: tuple[str, ...], view: WorkspaceView, cfg: ExplainConfig,
          frames_of: CameraFrames) -> list[Path]:
    """One page: a row per failure (``failures``, already cut to explain.failures_per_page), and,
    when the failures have camera frames, each failure's thumbnail strip (the row's last panel, and
    ``frames/<group>-<page>-<failure>.png`` at full resolution). Returns the strips written."""
    plt = _pyplot()
    shown = {f.episode_id: nearest_windows(record, f.episode_id, cfg.windows_shown) for f in failures}
    strips = {f.episode_id: _failure_strip(f, shown[f.episode_id], record.window, frames_of) for f in failures}
    cameras = any(strip is not None for strip in strips.values())
    cols = 1 + cfg.windows_shown + (2 if cameras else 0)  # the strip spans two panels
    fig, axes = plt.subplots(len(failures), cols, figsize=(PANEL_INCHES * cols, PANEL_INCHES * len(failures) + 0.8),
                             dpi=cfg.dpi, squeeze=False, layout="constrained")
    written = []
    for row, failure in zip(axes, failures, strict=True):
        failed = episodes[failure.episode_id]
        _failure_panel(row[0], failure, failed, stage_name(failed, stages), stages, view)
        matches = shown[failure.episode_id]
        strip = strips[failure.episode_id]
        if cameras:
            grid = row[-1].get_gridspec()
            for ax in row[-2:]:
                ax.remove()
            panel = fig.add_subplot(grid[list(axes[:, 0]).index(row[0]), cols - 2:])
            row = row[:-2]
            if strip is None:
                panel.axis("off")
                panel.text(0.5, 0.5, "no camera frames", ha="center", va="center", fontsize=7, transform=panel.transAxes)
            else:
                keys = sorted(frames_of(failure.episode_id))
                _strip_panel(panel, strip, keys, 1 + len(matches))
                target = path.parent.parent / "frames" / f"{path.parent.name}-{path.stem}-{_safe(failure.episode_id[:8])}.png"
                target.parent.mkdir(parents=True, exist_ok=True)
                _save_rgb(target, strip)
                written.append(target)
        for ax, match in zip(row[1:], matches, strict=False):
            _match_panel(ax, match, episodes[match.episode_id], failed, record.window, view)
        for ax in row[1 + len(matches):]:
            ax.axis("off")
            ax.text(0.5, 0.5, "no match kept" if not matches else "no more matches", ha="center", va="center",
                    fontsize=7, transform=ax.transAxes)
    head = f"{title}: {len(failures)} of {total} failures"
    if len(failures) < total:
        head += f" shown (truncated at explain.failures_per_page={cfg.failures_per_page}; all in index.json)"
    fig.suptitle(f"{head}\nred: failure (X = divergence, thick = context); green: retrieved success window, "
                 f"dashed red: the failure's query window; * target", fontsize=8)
    fig.savefig(path, metadata=PNG_METADATA)
    plt.close(fig)
    return written


def _save_rgb(path: Path, image: np.ndarray) -> None:
    """An (H, W, 3) uint8 image as a PNG of exactly that size (no resampling, no timestamp)."""
    import matplotlib.image

    matplotlib.image.imsave(path, image, metadata=PNG_METADATA)


def _own_cameras(episodes: Mapping[str, Episode]) -> CameraFrames:
    return lambda episode_id: episodes[episode_id].cameras


def _ordered(failures: Sequence[FailureRecord]) -> list[FailureRecord]:
    """Failures with a divergence first (they say where the policy left the successes), then by id."""
    return sorted(failures, key=lambda f: (f.fallback, f.episode_id))


# -- everything ----------------------------------------------------------------------------------
def explain(
    record: RetrievalRecord,
    training_episodes: Sequence[Episode],
    stages: tuple[str, ...],
    view: WorkspaceView,
    cfg: ExplainConfig,
    out_dir: Path,
    after: StageCounts | None = None,
    champion: StageCounts | None = None,
    camera_frames: CameraFrames | None = None,
) -> Explanation:
    """Write the pages, the stage table and ``index.json`` under ``out_dir``; return what was written.

    ``training_episodes``: the episodes of the dataset the round trained on (every episode the
    record names must be among them). ``camera_frames``: an episode's camera frames by id (e.g.
    decoded from the dataset for the episodes shown only); default: the episodes' own
    ``cameras``. Failures with frames get their thumbnail strips; without, the pages are as before."""
    episodes = {ep.episode_id: ep for ep in training_episodes}
    missing = sorted(record.episode_ids() - set(episodes))
    if missing:
        raise ValueError(
            f"{len(missing)} episodes the retrieval record names are not in the training data given (first: {missing[0]}); "
            "pass the dataset snapshot the model was trained on"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    pages: list[Page] = []
    frames_of = camera_frames or _own_cameras(episodes)
    strips: list[Path] = []

    by_robot: dict[str, list[FailureRecord]] = {}
    for failure in record.failures:
        by_robot.setdefault(failure.robot_id, []).append(failure)
    robots = sorted(by_robot, key=lambda r: (-len(by_robot[r]), r))
    kept, left_out = robots[: cfg.max_robot_pages], sorted(robots[cfg.max_robot_pages:])
    by_stage: dict[str, list[FailureRecord]] = {}
    for failure in record.failures:
        by_stage.setdefault(stage_name(episodes[failure.episode_id], stages), []).append(failure)
    stage_order = [s for s in stages if s in by_stage] + sorted(set(by_stage) - set(stages))

    groups = [("robot", r, Path("by-robot") / f"{_safe(r)}.png", by_robot[r]) for r in kept]
    groups += [("stage", s, Path("by-stage") / f"{i}-{_safe(s)}.png", by_stage[s]) for i, s in enumerate(stage_order)]
    for group, key, rel, members in groups:
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shown = _ordered(members)[: cfg.failures_per_page]
        strips += _page(out_dir / rel, f"{group} {key}", shown, len(members), episodes, record, stages, view, cfg,
                        frames_of)
        pages.append(Page(str(rel), group, key, [f.episode_id for f in shown], len(members)))

    table = stage_table(training_episodes, record, stages, after, champion)
    written = [out_dir / p.path for p in pages] + strips + list(write_stage_table(table, out_dir, cfg.dpi))
    result = Explanation(str(out_dir), record.method, len(record.failures), len(record.matches), pages, table,
                         [str(p.relative_to(out_dir)) for p in written] + ["index.json"], left_out)
    index = {**result.to_dict(), "out_dir": ".", "all_failures": {
        f.episode_id: {"robot_id": f.robot_id, "stage": stage_name(episodes[f.episode_id], stages),
                       "divergence_step": f.divergence_step, "fallback": f.fallback,
                       "matches": len(record.matches_of(f.episode_id))} for f in sorted(record.failures, key=lambda f: f.episode_id)}}
    (out_dir / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return result
