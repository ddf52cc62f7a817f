"""Collect step: scripted-expert demos, or the fleet running a policy for a fixed time per robot."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from components.config import EpisodesConfig, Settings
from components.episodes.record import Episode
from components.episodes.schema import write_episode_file
from components.pipeline.workspace import Workspace
from components.policy.actor import PolicyActor
from components.policy.normalizer import NormalizedPolicy
from components.sim.collect import Policy, collect, run_episodes
from components.sim.factory import make_expert, make_exploration, make_thresholded

EXPERT_VERSION = "expert"


@dataclass(frozen=True)
class CollectResult:
    files: list[Path]
    episodes: int
    successes: int
    env_steps: int
    seconds: float
    policy_version: str
    folder: Path | None = None  # where ``files`` were written

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else float("nan")

    def reference(self) -> CollectResult:
        """The same result naming its folder instead of every file: what a flow hands on (a round at
        96 robots writes thousands of files; ingest reads a folder as the episode files under it)."""
        return dataclasses.replace(self, files=[self.folder]) if self.folder is not None else self


def write_episodes(episodes: list[Episode], out_dir: Path, cfg: EpisodesConfig) -> list[Path]:
    """One Parquet file per episode, the same form a robot uploads: its camera streams (if the
    sim records any) beside it as ``<stem>.<camera key>.mp4``, encoded at the dataset's fps with
    its encoder settings (``cfg``: ``settings.episodes``). Returns the Parquet files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for ep in episodes:
        files.append(write_episode_file(ep, out_dir / f"{ep.robot_id}_{ep.episode_id}.parquet", cfg))
    return files


def fleet_actor(settings: Settings, policy: NormalizedPolicy, seed: int, explore: bool, motion: bool = True) -> Policy:
    """The policy as the fleet executes it: exploring (jaw sampled; motion noise unless ``motion``
    is False), or thresholded (the deployed policy)."""
    actor = PolicyActor(policy, threads=settings.runtime.torch_threads)
    if explore and settings.fleet.sample_gripper:
        return make_exploration(settings.sim, actor, seed, motion=motion)
    return make_thresholded(settings.sim, actor)


def collect_expert_demos(settings: Settings, out_dir: Path) -> CollectResult:
    """Expert demonstrations (the simulator's scripted expert) from the first ``demo.expert_robots`` robots."""
    start = time.perf_counter()
    robots = settings.fleet.robot_ids(settings.demo.expert_robots)
    episodes = run_episodes(
        make_expert(settings.sim), robots, settings.sim, settings.demo.expert_episodes_per_robot,
        seed=settings.seed, policy_version=EXPERT_VERSION,
    )
    files = write_episodes(episodes, out_dir, settings.episodes)
    steps = sum(ep.length for ep in episodes)
    return CollectResult(files, len(episodes), sum(ep.success for ep in episodes), steps, time.perf_counter() - start,
                         EXPERT_VERSION, out_dir)


def collect_expert(settings: Settings) -> CollectResult:
    """The bootstrap's demos, where the loop keeps them (``datasets/incoming/expert``)."""
    return collect_expert_demos(settings, settings.paths.incoming / "expert")


ROUND_DIR = "round-{:03d}"


def next_round(settings: Settings) -> int:
    """1 + the highest round already collected under ``datasets/incoming``."""
    done = [int(p.name.split("-")[1]) for p in settings.paths.incoming.glob("round-*") if p.name.split("-")[1].isdigit()]
    return max(done, default=0) + 1


def collect_fleet(
    settings: Settings, policy: NormalizedPolicy, policy_version: str, out_dir: Path, round_index: int,
    num_robots: int | None = None,
) -> CollectResult:
    """The fleet runs ``policy`` for ``fleet.steps_per_robot`` steps per robot; finished episodes are written out."""
    start = time.perf_counter()
    robots = settings.fleet.robot_ids(num_robots)
    seed = settings.seed * 1000 + round_index
    actor = fleet_actor(settings, policy, seed, explore=True)
    result = collect(actor, robots, settings.sim, settings.fleet.steps_per_robot, seed=seed, policy_version=policy_version)
    files = write_episodes(result.episodes, out_dir, settings.episodes)
    return CollectResult(
        files, len(result.episodes), sum(ep.success for ep in result.episodes), result.env_steps,
        time.perf_counter() - start, policy_version, out_dir,
    )


def collect_round(settings: Settings, round_index: int, champion_version: int, num_robots: int | None = None) -> CollectResult:
    """Round ``round_index`` of the fleet on registry version ``champion_version``, into
    ``datasets/incoming/round-NNN``; deterministic in its arguments (seeded fleet, fixed weights)."""
    policy = Workspace(settings).registry.load(champion_version)
    out = settings.paths.incoming / ROUND_DIR.format(round_index)
    return collect_fleet(settings, policy, f"v{champion_version}", out, round_index, num_robots)
