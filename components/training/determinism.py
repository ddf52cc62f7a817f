"""Seeds and devices: every training path takes its seed from config and runs on `device: auto`."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; returns a torch generator for data order."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def resolve_device(setting: str) -> torch.device:
    """`auto` = CUDA when present, else CPU; `cuda` without a GPU is an error with the fix."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was requested but no CUDA GPU is visible; set device: auto or cpu in params.yaml")
    return torch.device(setting)
