"""A vision policy: a small conv encoder per camera, optionally with the state, then an MLP head.

    packed observation (B, dim) ─ ObservationLayout.unpack ─► state (B, n), images (B, 3, H, W) per camera
    each camera ─ conv encoder (its own weights) ─► spatial softmax keypoints ─► linear ─► feature
    [features | state (policy.vision_state)] ─ MLP (policy.layers x policy.hidden) ─► action (B, m)
                                                                            or chunk (B, k, m)

The encoder is the one visuomotor policies have used since Levine et al. 2016 and that diffusion
policy / LeRobot keep: strided convolutions, then a spatial softmax that turns each feature map into
the expected (x, y) of its activation, a representation of *where* things are, which is what a
pick-and-place policy needs. Pixels arrive already normalized to [-1, 1] (``NormalizedPolicy``'s
observation normalizer holds the fixed scale for them, ``observation.PIXEL_SCALE``), the state in its
fitted units. Augmentation happens before the model, in the training workflow
(``training/augment.py``), so the model stays a plain function of what the robot saw.

``policy.vision_chunk`` > 1 predicts the next k actions (ACT-style chunks, executed with temporal
ensembling by ``policy/ensemble.py``); targets come from ``history.gather_chunks`` as for
``chunk_transformer``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from components.config import PolicyConfig
from components.policy.observation import ObservationLayout


class SpatialSoftmax(nn.Module):
    """(B, C, H, W) feature maps -> (B, 2C): each channel's softmax-weighted mean pixel position in [-1, 1]."""

    def forward(self, maps: Tensor) -> Tensor:
        b, c, h, w = maps.shape
        weights = F.softmax(maps.reshape(b, c, h * w), dim=-1).reshape(b, c, h, w)
        ys = torch.linspace(-1.0, 1.0, h, device=maps.device, dtype=maps.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=maps.device, dtype=maps.dtype)
        return torch.cat([(weights.sum(dim=2) * xs).sum(-1), (weights.sum(dim=3) * ys).sum(-1)], dim=-1)


class CameraEncoder(nn.Module):
    """Three 3x3 convolutions (the first two strided) -> spatial softmax -> ``feature`` numbers."""

    def __init__(self, channels: int, feature: int) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(3, channels, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(channels, channels, 3, padding=1),
        )
        self.keypoints = SpatialSoftmax()
        self.project = nn.Linear(2 * channels, feature)

    def forward(self, image: Tensor) -> Tensor:
        return self.project(self.keypoints(self.convs(image)))


class VisionPolicy(nn.Module):
    """Policy interface: ``forward(packed (B, layout.dim)) -> action (B, m)`` or chunk (B, chunk, m)."""

    def __init__(self, layout: ObservationLayout, act_dim: int, cfg: PolicyConfig) -> None:
        super().__init__()
        if not layout.cameras:
            raise ValueError("policy.kind=vision needs camera frames: set sim.cameras (e.g. [scene, gripper]) so the "
                             "fleet records them, and train on episodes ingested with their camera streams")
        self.layout, self.act_dim, self.chunk = layout, act_dim, cfg.vision_chunk
        self.replan_every, self.ensemble_decay = min(cfg.replan_every, cfg.vision_chunk), cfg.ensemble_decay
        self.uses_state = cfg.vision_state
        self.encoders = nn.ModuleList(CameraEncoder(cfg.vision_channels, cfg.vision_feature) for _ in layout.cameras)
        width = cfg.vision_feature * len(layout.cameras) + (layout.state_dim if cfg.vision_state else 0)
        layers: list[nn.Module] = []
        for _ in range(cfg.layers):
            layers += [nn.Linear(width, cfg.hidden), nn.GELU()]
            width = cfg.hidden
        layers.append(nn.Linear(width, act_dim * self.chunk))
        self.head = nn.Sequential(*layers)
        self.aux_loss = torch.zeros(())

    def forward(self, packed: Tensor) -> Tensor:
        if packed.dim() != 2 or packed.shape[1] != self.layout.dim:
            raise ValueError(f"VisionPolicy: expected packed observations (B, {self.layout.dim}) = state "
                             f"{self.layout.state_dim} + cameras {list(self.layout.keys)} (policy/observation.py), "
                             f"got {tuple(packed.shape)}")
        state, images = self.layout.unpack(packed)
        parts = [encoder(image.contiguous()) for encoder, image in zip(self.encoders, images, strict=True)]
        if self.uses_state:
            parts.append(state)
        out = self.head(torch.cat(parts, dim=-1))
        return out if self.chunk == 1 else out.view(len(out), self.chunk, self.act_dim)
