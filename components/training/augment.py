"""Image augmentation for a vision policy's training batches: a seeded random shift, bit-reproducible.

    frames (steps, B, H, W, 3) uint8 per camera ─ shift each image by (dy, dx) in [-s, s]
    (edge pixels repeated: DrQ's pad-and-crop) ─ pack with the states ─► (steps, B, dim) float32

The shifts of iteration ``i`` come from a generator seeded by ``(seed, i)`` alone (the batch
sampler's rule, ``bc.iteration_seed``, on a stream of its own), and a shift is pure integer
indexing, so every plan, process and resumed run gives the same augmented batches, bit for bit on
CPU. ``policy.augment_shift = 0`` packs the frames unchanged. Random shifts are the augmentation that
makes small-data visuomotor learning work (DrQ, Kostrikov et al. 2020; diffusion policy's crops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.policy.observation import ObservationLayout
from components.training.bc import iteration_seed

AUGMENT_STREAM = 11  # keeps the shifts apart from the batch (7) and validation streams of the same seed


def shift_images(frames: Tensor, shift: int, generator: torch.Generator) -> Tensor:
    """(..., H, W, 3) uint8 -> the same, each image shifted by its own (dy, dx) in [-shift, shift]."""
    if shift <= 0:
        return frames
    *lead, h, w, c = frames.shape
    flat = frames.reshape(-1, h, w, c)
    n = len(flat)
    offsets = torch.randint(-shift, shift + 1, (n, 2), generator=generator)
    rows = (torch.arange(h).unsqueeze(0) + offsets[:, :1]).clamp_(0, h - 1)  # (n, H)
    cols = (torch.arange(w).unsqueeze(0) + offsets[:, 1:]).clamp_(0, w - 1)  # (n, W)
    picked = flat[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
    return picked.reshape(*lead, h, w, c)


def augment_and_pack(states: Tensor, frames: dict[str, Tensor], layout: ObservationLayout, shift: int,
                     seed: int, iteration: int) -> Tensor:
    """The policy's packed observations (..., ``layout.dim``) of iteration ``iteration``'s batches."""
    generator = torch.Generator().manual_seed(iteration_seed(seed, iteration, AUGMENT_STREAM))
    parts = [states.float()]
    for cam in layout.cameras:  # one draw per camera, in the layout's order
        shifted = shift_images(frames[cam.key], shift, generator)
        parts.append(shifted.reshape(*states.shape[:-1], cam.size).float())
    return torch.cat(parts, dim=-1)
