"""Predict: every pipeline rank's peak memory for a ParallelPlan from a fitted MemoryModel. Pure
Python (no torch).

    from capture_megatron.predict import predict
    stages = predict(model, shape, plan)        # one StageMemory per pipeline rank
    worst = max(s.peak for s in stages)

schedule replays megatron-core's pipeline schedules, static computes parameter / gradient /
optimizer bytes under Megatron's buffer layout, ranks simulates each rank over its schedule, and
heldout checks a fitted variant against measured probes.
"""

from capture_megatron.predict.ranks import (
    StageMemory,
    chunk_cost,
    find_variant,
    predict,
    rank_memory,
    sizes_for,
    variant_of,
)

__all__ = [
    "StageMemory",
    "chunk_cost",
    "find_variant",
    "predict",
    "rank_memory",
    "sizes_for",
    "variant_of",
]
