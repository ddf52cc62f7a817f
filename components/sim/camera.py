"""RGB cameras for the built-in 2D sims: a small numpy rasterizer of the scene, every robot at once.

Two views per robot (``sim.cameras`` names which render): **scene**, a fixed camera looking down at
the whole table, and **gripper**, a camera on the jaw looking down at ``+- gripper_view_half_width``
around it. The world is drawn as labels first (table, grid lines, goal, container, object,
gripper: a ring whose hole is the jaw opening) and coloured by one palette lookup, so a frame costs
a few vector operations per body over a (robots, height, width) grid.

Each robot's cameras have its own quirks (``RobotProfile.camera``, from (population seed, robot
id)): the view's centre shifted and rolled (mount offset), a brightness and per-channel gain
(exposure, white balance), Gaussian pixel noise, and dropped frames (the camera delivers nothing
new and the last frame repeats; never the first frame of an episode). Noise and drops come from a
camera stream per ``(seed, robot id)`` of their own, so the state observations, the physics and
every other stream are the same with cameras on or off.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from components.config import SimConfig
from components.sim.profile import RobotProfile

VIEWS: tuple[str, ...] = ("scene", "gripper")  # the views a sim can render (CameraQuirks rows)
STATE_KEY = "state"  # the observation Dict's state entry; the views are keyed by their names
_CAMERA_STREAM = 4  # salt: kept apart from the env's reset (1), step (2) and episode-id (3) streams

# what the scene view spans: the unit workspace plus a margin, centred on the table
SCENE_CENTRE = (0.5, 0.5)
SCENE_HALF_WIDTH = 0.55
GRID_PITCH = 0.25  # table grid lines every this many workspace units...
GRID_LINE = 0.08  # ...this fraction of a pitch wide (about a pixel of the scene view at 64 px)

# sizes of the drawn bodies (workspace units)
OBJECT_RADIUS = 0.03
GRIPPER_RADIUS = 0.04
GRIPPER_HOLE = 0.03  # the ring's hole at a fully open jaw; it shrinks with the opening
CONTAINER_WALL = 0.3  # a container ring's wall, as a fraction of its radius

# labels, and their colours (r, g, b in [0, 1])
FLOOR, TABLE, GRID, GOAL, CONTAINER, OBJECT, GRIPPER = range(7)
PALETTE = np.array(
    [
        [0.15, 0.15, 0.17],  # floor, outside the workspace
        [0.80, 0.74, 0.62],  # table
        [0.66, 0.60, 0.50],  # grid line
        [0.35, 0.75, 0.35],  # goal
        [0.25, 0.40, 0.85],  # container
        [0.90, 0.20, 0.15],  # object
        [0.20, 0.20, 0.22],  # gripper
    ],
    dtype=np.float32,
) * np.float32(255.0)


@dataclass(frozen=True)
class Disc:
    """A body as the cameras draw it: discs (or rings, with a hole) of one label, one per robot."""

    label: int
    centres: np.ndarray  # (B, 2) workspace xy
    radius: float | np.ndarray  # scalar or (B,)
    hole: float | np.ndarray = 0.0  # inner radius of a ring; 0 = a full disc


def gripper_disc(gripper: np.ndarray, opening: np.ndarray) -> Disc:
    """The gripper: a ring whose hole shows the jaw opening (wide open, small holding, none closed)."""
    return Disc(GRIPPER, gripper, GRIPPER_RADIUS, GRIPPER_HOLE * np.clip(opening, 0.0, 1.0))


def camera_keys(cfg: SimConfig) -> tuple[str, ...]:
    """The views that render, in ``VIEWS`` order (sim.cameras may list them in any)."""
    return tuple(v for v in VIEWS if v in cfg.cameras)


def observation_space(cfg: SimConfig, state: gym.spaces.Box) -> gym.spaces.Space:
    """The state ``Box`` alone without cameras; with them a ``Dict`` of it and one uint8 image per view."""
    keys = camera_keys(cfg)
    if not keys:
        return state
    shape = (cfg.camera.height, cfg.camera.width, 3)
    images = {k: gym.spaces.Box(0, 255, shape, np.uint8) for k in keys}
    return gym.spaces.Dict({STATE_KEY: state, **images})


class FleetCameras:
    """The views of ``sim.cameras`` for every robot of a fleet env, each with its robot's quirks."""

    def __init__(self, cfg: SimConfig, profiles: list[RobotProfile], hashes: list[int], seed: int) -> None:
        self.cfg = cfg.camera
        self.keys = camera_keys(cfg)
        self._views = [VIEWS.index(k) for k in self.keys]
        self._hashes = hashes
        quirks = [p.camera for p in profiles]
        self._offset = np.stack([q.mount_offset for q in quirks]).astype(np.float32)  # (B, views, 2)
        rotation = np.stack([q.mount_rotation for q in quirks])
        self._cos, self._sin = np.cos(rotation).astype(np.float32), np.sin(rotation).astype(np.float32)
        self._gain = np.stack([q.exposure * q.white_balance for q in quirks]).astype(np.float32)  # (B, 3)
        self._noise_std = np.array([q.pixel_noise for q in quirks], dtype=np.float32)
        self._drop_rate = np.array([q.drop_rate for q in quirks])
        h, w = self.cfg.height, self.cfg.width
        # pixel centres in [-1, 1], image row 0 at the top (+y)
        self._u = ((np.arange(w, dtype=np.float32) + 0.5) / w * 2.0 - 1.0)[None, None, :]
        self._v = (1.0 - (np.arange(h, dtype=np.float32) + 0.5) / h * 2.0)[None, :, None]
        self._last = {k: np.zeros((len(profiles), h, w, 3), np.uint8) for k in self.keys}
        self.seed(seed)

    def seed(self, seed: int) -> None:
        self._rngs = [np.random.default_rng([seed, h, _CAMERA_STREAM]) for h in self._hashes]

    def draw(self) -> None:
        """This step's pixel noise and drops, per robot from its own stream (one draw per step)."""
        shape = (len(self.keys), self.cfg.height, self.cfg.width, 3)
        self._noise = np.stack([g.standard_normal(shape, dtype=np.float32) for g in self._rngs])
        self._drop = np.stack([g.random(len(self.keys)) for g in self._rngs]) < self._drop_rate[:, None]

    def capture(self, bodies: list[Disc], gripper: np.ndarray, rows: np.ndarray, fresh: np.ndarray) -> dict[str, np.ndarray]:
        """Frames of ``rows`` (env indices) for every view, drawn from ``bodies``; see ``deliver``."""
        drawn = {key: self._draw(bodies, gripper, rows, view) for key, view in zip(self.keys, self._views)}
        return self.deliver(drawn, rows, fresh)

    def deliver(self, drawn: dict[str, np.ndarray], rows: np.ndarray, fresh: np.ndarray) -> dict[str, np.ndarray]:
        """What the robots' cameras deliver of ``drawn`` ((len(rows), H, W, 3) per view, 0..255):
        their exposure, white balance and noise applied; a dropped frame repeats the row's last
        one unless ``fresh`` (the first frame of an episode, (len(rows),) bool)."""
        out: dict[str, np.ndarray] = {}
        for slot, key in enumerate(self.keys):
            image = drawn[key].astype(np.float32) * self._gain[rows][:, None, None, :]
            image += self._noise[rows, slot] * self._noise_std[rows][:, None, None, None]
            frames = np.clip(image, 0.0, 255.0).astype(np.uint8)
            dropped = self._drop[rows, slot] & ~fresh
            frames[dropped] = self._last[key][rows[dropped]]
            self._last[key][rows] = frames
            out[key] = frames
        return out

    def _draw(self, bodies: list[Disc], gripper: np.ndarray, rows: np.ndarray, view: int) -> np.ndarray:
        """The scene as ``view`` sees it from each row's mount: labels, coloured by ``PALETTE``."""
        centre, half = (np.asarray(SCENE_CENTRE), SCENE_HALF_WIDTH) if VIEWS[view] == "scene" else (
            gripper[rows], self.cfg.gripper_view_half_width)
        centre = (np.broadcast_to(centre, (len(rows), 2)) + self._offset[rows, view]).astype(np.float32)
        cos, sin = self._cos[rows, view][:, None, None], self._sin[rows, view][:, None, None]
        u, v = self._u * np.float32(half), self._v * np.float32(half)
        x = centre[:, 0, None, None] + cos * u - sin * v  # (n, H, W) world coordinates of each pixel
        y = centre[:, 1, None, None] + sin * u + cos * v
        labels = self._table(x, y)
        for body in bodies:
            cx = body.centres[rows, 0].astype(np.float32)[:, None, None]
            cy = body.centres[rows, 1].astype(np.float32)[:, None, None]
            d2 = (x - cx) ** 2 + (y - cy) ** 2
            inside = d2 < (_per_row(body.radius, rows) ** 2)
            if np.any(np.asarray(body.hole) > 0):
                inside &= d2 >= _per_row(body.hole, rows) ** 2
            labels[inside] = body.label
        return PALETTE[labels]

    @staticmethod
    def _table(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        on_table = (x >= 0.0) & (x <= 1.0) & (y >= 0.0) & (y <= 1.0)
        line = (np.mod(x, GRID_PITCH) < GRID_PITCH * GRID_LINE) | (np.mod(y, GRID_PITCH) < GRID_PITCH * GRID_LINE)
        return np.where(on_table, np.where(line, GRID, TABLE), FLOOR).astype(np.uint8)


def _per_row(value: float | np.ndarray, rows: np.ndarray) -> np.ndarray | np.float32:
    if np.ndim(value) == 0:
        return np.float32(value)
    return np.asarray(value, dtype=np.float32)[rows][:, None, None]
