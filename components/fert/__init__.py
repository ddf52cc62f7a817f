"""FERT: failure-guided experience retrieval fine-tuning, and its baselines. See README.md."""

# The room's window encoders register themselves with the store's encoder table on import, so a
# store they embedded can be opened by anything that imports fert (reproduce, explain, the fleet).
import components.fert.camera_encoder  # noqa: F401
import components.fert.encoder  # noqa: F401

from components.fert.divergence import (
    DivergenceThreshold,
    FailureContext,
    calibrate_threshold,
    failure_contexts,
    first_divergence,
    nearest_success_distance,
)
from components.fert.methods import DEMO_VERSION, METHODS, FertReport, MethodTrainingSet, build_training_set
from components.fert.mixing import PoolShares, mix_pools, pool_shares, sampling_probabilities
from components.fert.priority import FrameTable, PriorityWeights, priority_weights, resolve_sigma
from components.fert.retrieval import Retrieved, retrieve

__all__ = [
    "DEMO_VERSION",
    "METHODS",
    "DivergenceThreshold",
    "FailureContext",
    "FertReport",
    "FrameTable",
    "MethodTrainingSet",
    "PoolShares",
    "PriorityWeights",
    "Retrieved",
    "build_training_set",
    "calibrate_threshold",
    "failure_contexts",
    "first_divergence",
    "mix_pools",
    "nearest_success_distance",
    "pool_shares",
    "priority_weights",
    "resolve_sigma",
    "retrieve",
    "sampling_probabilities",
]
