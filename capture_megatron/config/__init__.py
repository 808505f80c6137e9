"""The objects that pass between stages, pure Python (no torch): what a model is (ModelShape), how
it is split (ParallelPlan, Recompute), where it runs (Cluster), what the user fixed (ParallelFlags),
how it trains (TrainConfig and its options), and Megatron's pipeline-split rules (layout).

Every field that a Megatron flag sets declares that flag (capture_megatron.fields).
"""

from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.kernels import Kernels
from capture_megatron.config.model import GIB, ModelShape, dtype_bytes
from capture_megatron.config.parallel import Cluster, ParallelFlags, ParallelPlan, Recompute
from capture_megatron.config.training import (
    BuildOptions,
    CheckpointOptions,
    DataOptions,
    OptimOptions,
    RunOptions,
    TrainConfig,
)

__all__ = [
    "GIB",
    "Kernels",
    "BuildOptions",
    "CheckpointOptions",
    "Cluster",
    "DataOptions",
    "DdpOptions",
    "ModelShape",
    "OptimOptions",
    "ParallelFlags",
    "ParallelPlan",
    "Recompute",
    "RunOptions",
    "TrainConfig",
    "dtype_bytes",
]
