"""What a policy observes, as one flat vector: the state, then each camera's pixels.

    packed = [ state (n) | camera 1 pixels (H1*W1*3, uint8 values 0..255 as float32) | camera 2 ... ]

Every caller of a policy — the trainer, ``PolicyActor`` on a fleet, the registry's MLflow model
(pyfunc: one ``(B, dim)`` float array), the fleet inference service and the robot agent — passes
one ``(B, n)`` array, so a vision policy travels every path a state policy travels unchanged. Its
``ObservationLayout`` (saved inside the model) says where each camera's pixels sit; ``pack`` builds
the vector from a simulator's ``Dict`` observation (``sim/camera.py``) or a dataset's decoded
frames, ``unpack`` splits it back into a state and ``(B, cameras, 3, H, W)`` images in the model.

A state policy's layout has no cameras: ``dim`` is the state's and ``pack`` is the identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from components.episodes.record import camera_key

if TYPE_CHECKING:
    from torch import Tensor

    from components.config import PolicyConfig, SimConfig

PIXEL_SCALE = 127.5  # the normalizer maps a pixel's 0..255 to [-1, 1] (fixed: never fitted on data)


@dataclass(frozen=True)
class CameraShape:
    key: str  # the dataset feature key, e.g. observation.images.scene
    height: int
    width: int

    @property
    def size(self) -> int:
        return self.height * self.width * 3


@dataclass(frozen=True)
class ObservationLayout:
    state_dim: int
    cameras: tuple[CameraShape, ...] = ()

    @property
    def dim(self) -> int:
        return self.state_dim + sum(c.size for c in self.cameras)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(c.key for c in self.cameras)

    @classmethod
    def of(cls, state_dim: int, images: Mapping[str, np.ndarray] | None, keys: Sequence[str] | None = None
           ) -> ObservationLayout:
        """The layout of ``images`` (key -> (N, H, W, 3) uint8), cameras in ``keys`` order (default: sorted)."""
        images = images or {}
        order = list(keys) if keys is not None else sorted(images)
        return cls(state_dim, tuple(CameraShape(k, int(images[k].shape[-3]), int(images[k].shape[-2])) for k in order))

    def pack(self, state: np.ndarray, images: Mapping[str, np.ndarray]) -> np.ndarray:
        """``state`` (..., n) and each camera's ``(..., H, W, 3)`` uint8 frames -> ``(..., dim)`` float32."""
        state = np.asarray(state, dtype=np.float32)
        if not self.cameras:
            return state
        lead = state.shape[:-1]
        parts = [state]
        for cam in self.cameras:
            if cam.key not in images:
                raise KeyError(f"observation: no camera {cam.key!r}; the policy sees {list(self.keys)} "
                               "(set sim.cameras so the simulator renders them)")
            frames = np.asarray(images[cam.key])
            if frames.shape[-3:] != (cam.height, cam.width, 3):
                raise ValueError(f"observation: camera {cam.key!r} frames are {frames.shape[-3:]}, the policy "
                                 f"was trained on {(cam.height, cam.width, 3)} (sim.camera.height / width)")
            parts.append(frames.reshape(*lead, cam.size).astype(np.float32))
        return np.concatenate(parts, axis=-1)

    def unpack(self, packed: Tensor) -> tuple[Tensor, list[Tensor]]:
        """``(B, dim)`` -> the state ``(B, n)`` and one ``(B, 3, H, W)`` image per camera (same units)."""
        state = packed[:, : self.state_dim]
        images, offset = [], self.state_dim
        for cam in self.cameras:
            flat = packed[:, offset: offset + cam.size]
            images.append(flat.reshape(-1, cam.height, cam.width, 3).permute(0, 3, 1, 2))
            offset += cam.size
        return state, images


def configured_layout(state_dim: int, policy: PolicyConfig, sim: SimConfig) -> ObservationLayout:
    """The layout a policy of ``policy.kind`` is built with before any data is read (the registry's
    champion check, ``dvc repro``'s evaluate stage): the cameras it sees at the simulator's size,
    keys sorted as ``ObservationLayout.of`` sorts a training set's. A state policy: the state alone."""
    keys = sorted(camera_key(view) for view in policy.camera_views(tuple(sim.cameras)))
    return ObservationLayout(state_dim, tuple(CameraShape(k, sim.camera.height, sim.camera.width) for k in keys))


def sim_images(obs: Mapping[str, np.ndarray], state_key: str = "state") -> dict[str, np.ndarray]:
    """A simulator's ``Dict`` observation (``sim/camera.py``: the state and one entry per view) ->
    its frames keyed as the dataset keys them (``scene`` -> ``observation.images.scene``)."""
    return {camera_key(view): frames for view, frames in obs.items() if view != state_key}
