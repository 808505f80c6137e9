"""How a model's experts are probed (pure Python)."""

from __future__ import annotations

import dataclasses

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.forecast.routing import routing_factor
from capture_megatron.records import ExpertsProbe


def experts_probe(shape: ModelShape, plan: ParallelPlan) -> ExpertsProbe | None:
    """How `plan`'s MoE layers are probed (None for a dense model): capacity-padded routing as
    it is (exact); any other routing padded to the capacity that bounds it -- the capacity
    factor, else the dropless routing factor of the shape's routing case
    (capture_megatron.forecast.routing: the forecast, the planning factor or the worst case,
    experts / top-k). DeepEP, which megatron-core runs unpadded only, is probed as it runs:
    dropless at the factor (its --moe-imbalance-factor), or at the capacity factor without
    padding; the GPU kernel set's DeepEP receives the tokens of that bound
    (capture_megatron.megatron.moe.flex_forecast). Every probed layer is an MoE layer."""
    moe = shape.moe
    if not moe.enabled:
        return None
    if moe.moe_expert_capacity_factor:
        factor = moe.moe_expert_capacity_factor
        bound = "exact" if moe.moe_pad_expert_input_to_capacity else "capacity"
    else:
        factors = routing_factor(shape, plan)
        factor = factors.of(moe.routing_case)
        bound = "worst" if factor >= factors.bound else "imbalance"
    deepep = moe.moe_token_dispatcher_type == "flex" and moe.moe_flex_dispatcher_backend == "deepep"
    dropless = not moe.moe_expert_capacity_factor
    probed = dataclasses.replace(
        moe,
        moe_expert_capacity_factor=0.0 if deepep and dropless else factor,
        moe_pad_expert_input_to_capacity=not deepep,
        moe_imbalance_factor=factor if deepep and dropless else 0.0,
        moe_router_force_load_balancing=False,
        routing_case="forecast",
        router_lr_sum=None,
        moe_layer_freq="1",
        routing_bound=True,
    )
    return ExpertsProbe(probed, plan.ep, plan.expert_tp, bound)
