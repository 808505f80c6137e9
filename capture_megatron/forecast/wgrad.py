"""--delay-wgrad-compute in the forecast: what a layer's backward holds beyond a standard one
(capture_megatron.features.delay_wgrad), at the plan's routing (pure Python)."""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.features.delay_wgrad import hold
from capture_megatron.forecast.routing import routing_factor


def wgrad_hold(shape: ModelShape, plan: ParallelPlan, moe: tuple[bool, ...]) -> float:
    """Bytes the backward of the worst of these layers (per layer: an MoE layer?) holds beyond a
    standard backward under --delay-wgrad-compute: its queued weight-gradient inputs; 0 without
    the flag or layers. Routed experts at the capacity factor, else at the dropless routing
    factor of the shape's routing case (the same the probes pad to)."""
    if not plan.ddp.delay_wgrad_compute or not moe:
        return 0.0
    factor = 1.0
    if shape.moe.enabled:
        capacity = shape.moe.moe_expert_capacity_factor
        factor = capacity or routing_factor(shape, plan).of(shape.moe.routing_case)
    return float(max(hold(shape, plan, m, factor).peak for m in set(moe)))
