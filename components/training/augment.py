"""Image augmentation for a vision policy's training batches: a seeded random shift, bit-reproducible.

    frames (steps, B, H, W, 3) uint8 per camera ─ shift each image by (dy, dx) in [-s, s]
    (edge pixels repeated: DrQ's pad-and-crop) ─► CameraBatch (states, uint8 pixels)
    ─ the learner's step k ─► packed (B, dim) float32

The shifts of iteration ``i`` come from a generator seeded by ``(seed, i)`` alone (the batch
sampler's rule, ``bc.iteration_seed``, on a stream of its own), and a shift is pure integer
indexing, so every plan, process and resumed run gives the same augmented batches, bit for bit on
CPU. ``policy.augment_shift = 0`` packs the frames unchanged. Random shifts are the augmentation that
makes small-data visuomotor learning work (DrQ, Kostrikov et al. 2020; diffusion policy's crops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from components.policy.observation import ObservationLayout
from components.training.bc import iteration_seed

AUGMENT_STREAM = 11  # keeps the shifts apart from the batch (7) and validation streams of the same seed
NOISE_STREAM = 13  # the state jitter's own stream


def jitter_states(states: Tensor, scale: Tensor, seed: int, iteration: int, batch_size: int,
                  local: slice) -> Tensor:
    """``states`` (steps, B_local, [h,] n) plus Gaussian noise of std ``scale`` (n,) per number.

    The noise of iteration ``iteration`` is drawn for the *global* batch (``batch_size`` rows) from a
    generator seeded by ``(seed, iteration)`` on ``NOISE_STREAM``, and this rank's ``local`` rows are
    taken, so every plan, process and world size jitters a frame the same way. Noise on the inputs
    with clean targets teaches the policy to steer back from states a little off the demos, the
    states its own small errors lead to (the compounding error of behaviour cloning)."""
    generator = torch.Generator().manual_seed(iteration_seed(seed, iteration, NOISE_STREAM))
    steps, _, *rest = states.shape
    noise = torch.randn((steps, batch_size, *rest), generator=generator, dtype=states.dtype)[:, local]
    return states + noise * scale.to(states.dtype)


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


@dataclass(frozen=True)
class CameraBatch:
    """An iteration's observations before packing: the states (float) and every camera's shifted
    pixels side by side (uint8, the layout's order). Kept uint8 until the learner takes a step, so a
    batch that crosses to another process carries a quarter of the bytes of packed float32."""

    states: Tensor  # (steps, B, n)
    pixels: Tensor  # (steps, B, sum of H*W*3) uint8

    def __len__(self) -> int:
        return len(self.states)

    def to(self, device: torch.device | str) -> CameraBatch:
        return CameraBatch(self.states.to(device), self.pixels.to(device))

    def packed(self) -> Tensor:
        """The packed observations (..., ``layout.dim``) float32: what the policy takes."""
        return torch.cat([self.states.float(), self.pixels.float()], dim=-1)

    def step(self, k: int) -> Tensor:
        """Step ``k``'s packed observations (B, ``layout.dim``)."""
        return CameraBatch(self.states[k], self.pixels[k]).packed()


def augment(states: Tensor, frames: dict[str, Tensor], layout: ObservationLayout, shift: int, seed: int,
            iteration: int) -> CameraBatch:
    """Iteration ``iteration``'s batches, each image shifted (one draw per camera, layout order)."""
    generator = torch.Generator().manual_seed(iteration_seed(seed, iteration, AUGMENT_STREAM))
    lead = states.shape[:-1]
    pixels = [shift_images(frames[cam.key], shift, generator).reshape(*lead, cam.size) for cam in layout.cameras]
    return CameraBatch(states, torch.cat(pixels, dim=-1))


def augment_and_pack(states: Tensor, frames: dict[str, Tensor], layout: ObservationLayout, shift: int,
                     seed: int, iteration: int) -> Tensor:
    """The policy's packed observations (..., ``layout.dim``) of iteration ``iteration``'s batches."""
    return augment(states, frames, layout, shift, seed, iteration).packed()
