"""A window encoder over camera frames, trained on the fleet's own successful windows (no downloads).

``fert.encoder: camera``. Like ``ActionPredictiveEncoder`` (encoder.py) it learns a code from which
a linear head must predict the window's actions, but its input is what the robot's cameras saw:

    per window: `camera_frames` frames, evenly spaced first..last (W=8, 3 frames: 0, 4, 7)
    each frame, each view: block mean to `camera_size`^2 (64 px -> 16: 4x4 blocks), rounded to uint8
        --the vision policy's CameraEncoder (policy/vision.py: 3 convs, spatial softmax, linear)-->
        `feature` numbers per frame and view (one conv net per view, shared by the frames)
    [those of every frame and view | the z-scored states if `camera_state`]
        --Linear+tanh--> hidden --Linear--> code (N, dim)  --Linear--> actions (N, W*m)  [training only]

Why so small: on the shared 2-core machine the encoder runs over every window the fleet stores
(and every failure's windows at training time), so a frame costs one 16x16 conv net pass (~30k
multiply-adds at 8 channels) and a window 3 frames per view; spatial softmax keeps *where* the
gripper and the object are at sub-pixel precision, which is what the downsampling would
otherwise lose. Fitting is seeded torch on CPU; ``encode`` is numpy on the stored weights (an
im2col convolution), so the store rebuilds it from ``state_dict()`` (JSON) and a window embeds
the same wherever it is encoded (the store at ingest, the divergence detector at training).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Self

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from scipy.special import erf
from torch import nn

from components.episodes.record import Episode
from components.policy.vision import CameraEncoder
from components.store.encoder import ENCODERS, STD_FLOOR
from components.store.windows import camera_windows, cut_windows, window_count

HIDDEN = 64
FEATURE = 16  # numbers per frame and view (the CameraEncoder's projection)
LEARNING_RATE = 3e-3
BATCH = 128
MIN_STEPS = 300  # a first ingest of a few demos is a handful of batches: train long enough to learn anyway
PIXEL_SCALE = 127.5  # uint8 -> [-1, 1], as the vision policy sees pixels
_CONVS = (("c1", 2), ("c2", 2), ("c3", 1))  # the CameraEncoder's convs and their strides
PICK_STREAM = 13  # salt for the generator that picks the episodes a fit reads above max_windows


def downsample(frames: np.ndarray, size: int) -> np.ndarray:
    """(..., H, W, 3) uint8 -> (..., size, size, 3) uint8: the mean of each block (area resize) when
    ``size`` divides H and W, else the nearest pixel; a frame already ``size`` square is kept."""
    frames = np.asarray(frames)
    h, w = frames.shape[-3], frames.shape[-2]
    if (h, w) == (size, size):
        return frames.astype(np.uint8, copy=False)
    if h % size == 0 and w % size == 0:
        blocks = frames.reshape(*frames.shape[:-3], size, h // size, size, w // size, 3)
        return np.rint(blocks.mean(axis=(-4, -2), dtype=np.float32)).astype(np.uint8)
    rows = ((np.arange(size) + 0.5) * h / size).astype(np.int64)
    cols = ((np.arange(size) + 0.5) * w / size).astype(np.int64)
    return frames[..., rows, :, :][..., cols, :].astype(np.uint8, copy=False)


def _gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(np.float32)


def _conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """(B, C, H, W) -> (B, C', H', W'): a 3x3 convolution, padding 1 (torch's Conv2d), as one matmul."""
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    patches = sliding_window_view(padded, (3, 3), axis=(2, 3))[:, :, ::stride, ::stride]  # (B, C, H', W', 3, 3)
    b, c, ho, wo = patches.shape[:4]
    cols = patches.transpose(0, 2, 3, 1, 4, 5).reshape(b * ho * wo, c * 9)
    out = cols @ weight.reshape(len(weight), -1).T + bias
    return np.ascontiguousarray(out.reshape(b, ho, wo, -1).transpose(0, 3, 1, 2), dtype=np.float32)


def _spatial_softmax(maps: np.ndarray) -> np.ndarray:
    """policy/vision.py's SpatialSoftmax in numpy: (B, C, H, W) -> (B, 2C) expected (x..., y...)."""
    b, c, h, w = maps.shape
    flat = maps.reshape(b, c, h * w)
    e = np.exp(flat - flat.max(axis=-1, keepdims=True))
    weights = (e / e.sum(axis=-1, keepdims=True)).reshape(b, c, h, w)
    xs = np.linspace(-1.0, 1.0, w, dtype=np.float32)
    ys = np.linspace(-1.0, 1.0, h, dtype=np.float32)
    return np.concatenate([(weights.sum(axis=2) * xs).sum(-1), (weights.sum(axis=3) * ys).sum(-1)], axis=-1)


class CameraWindowEncoder:
    """Camera windows (and optionally states) -> code trained to predict the window's actions."""

    kind: ClassVar[str] = "camera_action_predictive"

    def __init__(
        self, window: int, cameras: Sequence[str], state_dim: int | None = None, dim: int = 16, epochs: int = 20,
        seed: int = 0, size: int = 16, frames: int = 3, channels: int = 8, use_state: bool = False,
    ) -> None:
        if window < 1 or dim < 1 or epochs < 1 or size < 4 or frames < 1 or channels < 1:
            raise ValueError(f"window, dim, epochs, frames, channels must be >= 1 and size >= 4, got "
                             f"{window}, {dim}, {epochs}, {frames}, {channels}, {size}")
        if not cameras:
            raise ValueError("the camera window encoder needs at least one camera key (observation.images.<view>)")
        self.window, self.cameras, self.state_dim = int(window), tuple(sorted(cameras)), state_dim
        self.code_dim, self.epochs, self.seed = int(dim), int(epochs), int(seed)
        self.size, self.frames, self.channels, self.use_state = int(size), int(frames), int(channels), bool(use_state)
        self.mean: np.ndarray | None = None  # (n,) state z-score (also kept without use_state: fit's targets)
        self.std: np.ndarray | None = None
        self.nets: dict[str, dict[str, np.ndarray]] | None = None  # per camera: c1..c3 weight/bias, project
        self.mlp: dict[str, np.ndarray] | None = None  # w1, b1, w2, b2

    @property
    def dim(self) -> int:
        return self.code_dim

    @property
    def positions(self) -> np.ndarray:
        """The frames of a window it looks at (evenly spaced, first and last included)."""
        return np.unique(np.rint(np.linspace(0, self.window - 1, self.frames)).astype(np.int64))

    # -- inputs ------------------------------------------------------------------------------------
    def _check(self, windows: np.ndarray, images: dict[str, np.ndarray] | None, what: str) -> np.ndarray:
        windows = np.asarray(windows, dtype=np.float32)
        if windows.ndim != 3 or windows.shape[1] != self.window:
            raise ValueError(f"{what}: expected state windows (N, {self.window}, n), got {windows.shape}")
        if self.state_dim is not None and windows.shape[2] != self.state_dim:
            raise ValueError(f"{what}: state dim {windows.shape[2]} != the encoder's {self.state_dim}")
        if not np.isfinite(windows).all():
            raise ValueError(f"{what}: windows contain NaN/inf")
        missing = [k for k in self.cameras if images is None or k not in images]
        if missing:
            raise ValueError(f"{what}: the camera window encoder needs images of {list(self.cameras)} "
                             f"(missing {missing}); the store passes them (store.encoder.encode_episodes)")
        for key in self.cameras:
            shape = np.shape(images[key])  # type: ignore[index]
            if len(shape) != 5 or shape[:2] != (len(windows), self.window) or shape[-1] != 3:
                raise ValueError(f"{what}: images[{key!r}] must be ({len(windows)}, {self.window}, H, W, 3), got {shape}")
        return windows

    def _picked(self, images: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """key -> (N, K, size, size, 3) uint8: the looked-at frames of each window, downsampled."""
        return {k: downsample(np.asarray(images[k])[:, self.positions], self.size) for k in self.cameras}

    def _z(self, windows: np.ndarray) -> np.ndarray:
        return ((windows - self.mean) / self.std).reshape(len(windows), -1).astype(np.float32)

    # -- fitting -----------------------------------------------------------------------------------
    @classmethod
    def from_successes(
        cls, episodes: Iterable[Episode], window: int, stride: int, cameras: Sequence[str], dim: int, epochs: int,
        seed: int, size: int = 16, frames: int = 3, channels: int = 8, use_state: bool = False,
    ) -> CameraWindowEncoder:
        """Fitted on the successful episodes' windows, their camera frames and their actions (what a
        store's first ingest does). ``episodes`` may be a generator: each is downsampled as it comes,
        so only the looked-at frames, small, are held."""
        encoder = cls(window, cameras, None, dim, epochs, seed, size, frames, channels, use_state)
        states, actions, picked = [], [], {k: [] for k in encoder.cameras}
        for ep in episodes:
            if not ep.success:
                continue
            cut = cut_windows(ep.states, window, stride)
            states.append(cut.windows)
            actions.append(cut_windows(ep.actions, window, stride).windows)
            missing = [k for k in encoder.cameras if k not in ep.cameras]
            if missing:
                raise ValueError(f"episode {ep.episode_id} has no camera stream {missing[0]!r}: fert.encoder=camera fits on "
                                 "episodes stored with their cameras (sim.cameras)")
            for k in encoder.cameras:
                looked = camera_windows(ep.cameras[k], cut.starts, window)[:, encoder.positions]
                picked[k].append(downsample(looked, size))
        if not states:
            raise ValueError("the camera window encoder needs successful episodes to learn from; ingest expert demos first")
        return encoder.fit_picked(np.concatenate(states), {k: np.concatenate(v) for k, v in picked.items()},
                                  np.concatenate(actions))

    def fit(self, windows: np.ndarray, images: dict[str, np.ndarray] | None = None) -> Self:
        """Without actions: predict the window's frame-to-frame state changes."""
        windows = self._check(windows, images, "CameraWindowEncoder.fit")
        return self.fit_picked(windows, self._picked(images), np.diff(windows, axis=1))  # type: ignore[arg-type]

    def fit_picked(self, windows: np.ndarray, picked: dict[str, np.ndarray], targets: np.ndarray) -> Self:
        """Train on (N, W, n) state windows, their looked-at frames (``_picked``) and (N, W', m) targets."""
        if len(windows) == 0 or len(targets) != len(windows):
            raise ValueError(f"need as many target rows as windows (> 0), got {len(targets)} for {len(windows)}")
        self.state_dim = int(windows.shape[2])
        frames64 = windows.reshape(-1, self.state_dim).astype(np.float64)
        std = frames64.std(axis=0)
        self.mean = frames64.mean(axis=0).astype(np.float32)
        self.std = np.where(std < STD_FLOOR, 1.0, std).astype(np.float32)
        y = torch.as_tensor(np.asarray(targets, dtype=np.float32).reshape(len(windows), -1))
        y = (y - y.mean(0)) / y.std(0).clamp_min(STD_FLOOR)
        pixels = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in picked.items()}  # uint8, small
        z = torch.as_tensor(self._z(windows)) if self.use_state else None

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small convs: one thread is 4-40x faster than two on the shared 2 cores, and fixed
        try:
            self._train(windows, pixels, z, y)
        finally:
            torch.set_num_threads(threads)
        return self

    def _train(self, windows: np.ndarray, pixels: dict[str, torch.Tensor], z: torch.Tensor | None, y: torch.Tensor) -> None:
        torch.manual_seed(self.seed)
        generator = torch.Generator().manual_seed(self.seed)
        k = len(self.positions)
        nets = nn.ModuleDict({_name(key): CameraEncoder(self.channels, FEATURE) for key in self.cameras})
        width = FEATURE * k * len(self.cameras) + (z.shape[1] if z is not None else 0)
        mlp = nn.Sequential(nn.Linear(width, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, self.code_dim))
        head = nn.Linear(self.code_dim, y.shape[1])
        optimizer = torch.optim.Adam([*nets.parameters(), *mlp.parameters(), *head.parameters()], lr=LEARNING_RATE)
        steps = max(MIN_STEPS, max(1, len(windows) // BATCH) * self.epochs)
        for _ in range(steps):
            idx = torch.randint(len(windows), (min(BATCH, len(windows)),), generator=generator)
            parts = []
            for key in self.cameras:
                x = pixels[key][idx].float().div(PIXEL_SCALE).sub(1.0)  # (B, K, s, s, 3)
                x = x.reshape(-1, self.size, self.size, 3).permute(0, 3, 1, 2)
                parts.append(nets[_name(key)](x).reshape(len(idx), -1))
            if z is not None:
                parts.append(z[idx])
            loss = nn.functional.mse_loss(head(mlp(torch.cat(parts, dim=1))), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        def arr(t: torch.Tensor) -> np.ndarray:
            return t.detach().numpy().astype(np.float32).copy()

        self.nets = {}
        for key in self.cameras:
            net = nets[_name(key)]
            convs = [m for m in net.convs if isinstance(m, nn.Conv2d)]
            self.nets[key] = {**{f"{n}_w": arr(c.weight) for (n, _), c in zip(_CONVS, convs, strict=True)},
                              **{f"{n}_b": arr(c.bias) for (n, _), c in zip(_CONVS, convs, strict=True)},
                              "proj_w": arr(net.project.weight).T.copy(), "proj_b": arr(net.project.bias)}
        self.mlp = {"w1": arr(mlp[0].weight).T.copy(), "b1": arr(mlp[0].bias),
                    "w2": arr(mlp[2].weight).T.copy(), "b2": arr(mlp[2].bias)}

    # -- encoding ----------------------------------------------------------------------------------
    def _features(self, key: str, pixels: np.ndarray) -> np.ndarray:
        """(N, K, s, s, 3) uint8 -> (N, K * FEATURE): the view's conv net on every looked-at frame."""
        net = self.nets[key]  # type: ignore[index]
        n = len(pixels)
        x = (pixels.reshape(-1, self.size, self.size, 3).astype(np.float32) / PIXEL_SCALE - 1.0).transpose(0, 3, 1, 2)
        for i, (name, stride) in enumerate(_CONVS):
            x = _conv(x, net[f"{name}_w"], net[f"{name}_b"], stride)
            if i < len(_CONVS) - 1:
                x = _gelu(x)
        keypoints = _spatial_softmax(x)
        return (keypoints @ net["proj_w"] + net["proj_b"]).reshape(n, -1).astype(np.float32)

    def encode(self, windows: np.ndarray, images: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """(N, W, n) state windows + key -> (N, W, H, W', 3) camera windows -> (N, dim) float32."""
        if self.nets is None or self.mlp is None:
            raise ValueError("CameraWindowEncoder.encode before fit(); fit it or load a state_dict")
        windows = self._check(windows, images, "CameraWindowEncoder.encode")
        if len(windows) == 0:
            return np.zeros((0, self.code_dim), dtype=np.float32)
        picked = self._picked(images)  # type: ignore[arg-type]
        parts = [self._features(k, picked[k]) for k in self.cameras]
        if self.use_state:
            parts.append(self._z(windows))
        x = np.concatenate(parts, axis=1)
        hidden = np.tanh(x @ self.mlp["w1"] + self.mlp["b1"])
        return np.ascontiguousarray(hidden @ self.mlp["w2"] + self.mlp["b2"], dtype=np.float32)

    # -- saving ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.nets is None or self.mlp is None or self.mean is None or self.std is None:
            raise ValueError("CameraWindowEncoder.state_dict before fit(); nothing to save")
        return {
            "kind": self.kind, "window": self.window, "cameras": list(self.cameras), "state_dim": self.state_dim,
            "dim": self.code_dim, "epochs": self.epochs, "seed": self.seed, "size": self.size, "frames": self.frames,
            "channels": self.channels, "use_state": self.use_state, "mean": self.mean.tolist(), "std": self.std.tolist(),
            "nets": {k: {n: a.tolist() for n, a in net.items()} for k, net in self.nets.items()},
            "mlp": {n: a.tolist() for n, a in self.mlp.items()},
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Self:
        if state.get("kind") != cls.kind:
            raise ValueError(f"state_dict kind {state.get('kind')!r} is not {cls.kind!r}")
        encoder = cls(int(state["window"]), tuple(state["cameras"]), int(state["state_dim"]), int(state["dim"]),
                      int(state["epochs"]), int(state["seed"]), int(state["size"]), int(state["frames"]),
                      int(state["channels"]), bool(state["use_state"]))
        encoder.mean = np.asarray(state["mean"], dtype=np.float32)
        encoder.std = np.asarray(state["std"], dtype=np.float32)
        encoder.nets = {k: {n: np.asarray(a, dtype=np.float32) for n, a in net.items()} for k, net in state["nets"].items()}
        encoder.mlp = {n: np.asarray(a, dtype=np.float32) for n, a in state["mlp"].items()}
        return encoder


def _name(key: str) -> str:
    return key.replace(".", "_")  # ModuleDict keys cannot hold dots


def pick_successes(lengths: Sequence[int], window: int, stride: int, max_windows: int, seed: int) -> np.ndarray:
    """Positions (ascending) of the successes a fit reads: all of them while their windows number at
    most ``max_windows``, else a seeded random pick of whole episodes up to about that many."""
    counts = np.array([window_count(int(n), window, stride) for n in lengths], dtype=np.int64)
    if counts.sum() <= max_windows:
        return np.arange(len(counts))
    order = np.random.default_rng([seed, PICK_STREAM]).permutation(len(counts))
    keep = order[: max(1, int(np.searchsorted(np.cumsum(counts[order]), max_windows, side="right")))]
    return np.sort(keep)


# The store rebuilds encoders by kind (store.load_encoder()); make this one known to it.
ENCODERS.setdefault(CameraWindowEncoder.kind, CameraWindowEncoder)
