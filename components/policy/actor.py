"""Running a torch policy on a fleet: numpy observations in, numpy commands out.

How the gripper command is *executed* (sampled during collection, thresholded in evaluation)
is the simulator's concern: wrap an actor in ``components.sim.exploration``.

A policy with an observation history (``policy.history`` > 1) gets each env's window from a
rolling buffer (``policy/history.FrameHistory``, the training rule); the fleet loop tells the
actor which envs start a new episode through ``end_episodes`` (``sim/collect.py`` does).

A chunk policy (``policy.kind: chunk_transformer``) is queried only for the envs whose step is due
(every ``policy.replan_every`` steps) and its chunks are executed with temporal ensembling
(``policy/ensemble.ChunkEnsemble``); every env's window is still pushed every step.

A vision policy (``policy.kind: vision``) says ``sees_cameras``, so the sim loops hand it the
simulator's ``Dict`` observation; the actor packs the state and the frames of the cameras the
policy was trained on into its one observation vector (``policy/observation.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from components.config import PolicyConfig
from components.policy.ensemble import ChunkEnsemble
from components.policy.history import FrameHistory
from components.policy.observation import ObservationLayout, sim_images


class PolicyActor:
    """Callable ``obs (B, n) -> actions (B, m)`` around a torch policy, in eval mode, no grad."""

    def __init__(self, policy: nn.Module, device: torch.device | str = "cpu",
                 execution: PolicyConfig | None = None, threads: int = 0) -> None:
        """``execution``: how a chunk policy's chunks run (``replan_every``, ``ensemble_decay``);
        default: as the policy was built (``NormalizedPolicy.chunk_execution``). ``threads`` > 0:
        each forward runs at that many torch intra-op threads (``runtime.torch_threads``; 0 = the
        caller's): a conv policy's batch-16 forward at 2 threads on 2 busy cores measured 7x slower
        than at 1 (evaluation rollouts: 24.9 s vs 3.6 s), as OpenMP threads wait on each other."""
        self.device = torch.device(device)
        self.threads = threads
        self.policy = policy.to(self.device).eval()
        self.layout: ObservationLayout | None = getattr(policy, "layout", None)
        self.sees_cameras = bool(self.layout is not None and self.layout.cameras)
        history = int(getattr(policy, "history", 1))
        self.frames = FrameHistory(history) if history > 1 else None
        chunk = int(getattr(policy, "chunk", 1))
        self.ensemble = None
        if chunk > 1:
            replan, decay = ((execution.replan_every, execution.ensemble_decay) if execution is not None
                             else policy.chunk_execution)
            self.ensemble = ChunkEnsemble(chunk, replan, decay)

    def end_episodes(self, envs: np.ndarray) -> None:
        """Envs (mask or indices) whose next observation is a new episode's first frame."""
        if self.frames is not None:
            self.frames.restart(envs)
        if self.ensemble is not None:
            self.ensemble.restart(envs)

    @torch.no_grad()
    def __call__(self, obs: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
        if isinstance(obs, dict):  # a simulator's Dict observation (sim.cameras): state + frames
            if not self.sees_cameras:
                obs = obs["state"]
            else:
                assert self.layout is not None
                obs = self.layout.pack(obs["state"], sim_images(obs))
        elif self.sees_cameras:
            assert self.layout is not None
            raise ValueError(f"this vision policy sees cameras {list(self.layout.keys)} but the simulator renders none: "
                             "set sim.cameras (FLEETLOOP_SIM__CAMERAS='[\"scene\", \"gripper\"]') to run it")
        obs = np.asarray(obs, dtype=np.float32)
        if self.frames is not None:
            obs = self.frames.push(obs)
        if self.ensemble is None:
            return self._forward(obs)
        due = self.ensemble.due(len(obs))
        if due.any():
            self.ensemble.add(self._forward(obs[due]), due)
        return self.ensemble.act()

    def _forward(self, obs: np.ndarray) -> np.ndarray:
        caller = torch.get_num_threads()
        if self.threads and caller != self.threads:
            torch.set_num_threads(self.threads)
        try:
            return self.policy(torch.as_tensor(obs, device=self.device)).float().cpu().numpy()
        finally:
            if torch.get_num_threads() != caller:
                torch.set_num_threads(caller)
