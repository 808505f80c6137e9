"""--delay-wgrad-compute in the forecast: what a layer's backward holds beyond a standard one
(capture_megatron.features.delay_wgrad), at the plan's routing (pure Python)."""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.features.delay_wgrad import WgradHold, hold
from capture_megatron.forecast.routing import routing_factor


def layer_hold(shape: ModelShape, plan: ParallelPlan, moe_layer: bool, factor: float) -> WgradHold:
    """The queued bytes of one layer (an MoE layer when `moe_layer`) under `plan`, its routed
    experts receiving `factor` x their balanced share: the attention's rows gathered
    (s x b / CP), the experts' the rank's tokens (s x b / (CP x TP)) x expert TP x top-k x
    factor."""
    t = plan.tp
    rows = shape.seq_length * plan.micro_batch_size // plan.cp
    heads, groups, d = shape.num_attention_heads, shape.groups, shape.head_dim
    attention = ((heads + 2 * groups) * d // t, heads * d // t)
    if moe_layer and shape.moe.enabled:
        moe = shape.moe
        tokens = rows // t * plan.expert_tp * moe.moe_router_topk
        mlp = (round(tokens * factor), shape.moe_ffn // plan.expert_tp, shape.gated)
        shared = moe.moe_shared_expert_intermediate_size // t
    else:
        mlp, shared = (rows, shape.ffn // t, shape.gated), 0
    return hold(rows, shape.hidden_size, attention, mlp, shared)


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
    return float(max(layer_hold(shape, plan, m, factor).peak for m in set(moe)))
