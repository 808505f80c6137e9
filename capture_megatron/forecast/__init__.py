"""Predict: every pipeline rank's peak memory for a ParallelPlan from a fitted MemoryModel. Pure
Python (no torch).

    from capture_megatron.forecast import predict
    stages = predict(model, shape, plan)        # one StageMemory per pipeline rank
    worst = max(s.peak for s in stages)

schedule replays megatron-core's pipeline schedules, static computes parameter / gradient /
optimizer bytes under Megatron's buffer layout, ranks simulates each rank over its schedule, and
heldout checks a fitted variant against measured probes.
"""

from capture_megatron.forecast.chunks import chunk_cost
from capture_megatron.forecast.layers import (
    Layers,
    find_variant,
    layers_for,
    mixed_layers,
    sizes_for,
    variant_of,
    variants_of,
)
from capture_megatron.forecast.ranks import StageMemory, predict, rank_memory, rank_peak

__all__ = [
    "Layers",
    "StageMemory",
    "chunk_cost",
    "find_variant",
    "layers_for",
    "mixed_layers",
    "predict",
    "rank_memory",
    "rank_peak",
    "sizes_for",
    "variant_of",
    "variants_of",
]
