"""What the memory forecast covers, and how a model's experts are probed (pure Python)."""

from __future__ import annotations

import dataclasses

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.records import ExpertsProbe


def refuse_unforecast(shape: ModelShape, plan: ParallelPlan) -> None:
    """CaptureError for what the memory model cannot forecast yet: CP > 1, MoE layers."""
    if plan.cp > 1:
        raise CaptureError(
            f"context parallelism CP {plan.cp}: capture-megatron trains this, but its memory "
            "forecast does not model it yet; leave out --context-parallel-size to forecast the "
            "run without it"
        )
    if shape.moe.enabled:
        raise CaptureError(
            "mixture-of-experts layers: capture-megatron trains them (EP, EP x PP, EP x TP), but "
            "its memory forecast does not model them yet (the probes of their chunks are not "
            "finished); leave out the MoE flags to forecast the dense model"
        )


def experts_probe(shape: ModelShape, plan: ParallelPlan) -> ExpertsProbe | None:
    """How `plan`'s MoE layers are probed (None for a dense model): capacity-padded routing as
    it is (exact); any other routing padded to the capacity that bounds it -- the capacity
    factor, else the user's --moe-imbalance-factor, else the worst case (capacity factor
    experts / top-k: every token of the expert's ranks routed to it). Reached only once
    refuse_unforecast lets MoE through (the probes of MoE chunks are not finished)."""
    moe = shape.moe
    if not moe.enabled:
        return None
    if moe.moe_expert_capacity_factor:
        factor = moe.moe_expert_capacity_factor
        bound = "exact" if moe.moe_pad_expert_input_to_capacity else "capacity"
    elif moe.moe_imbalance_factor:
        factor = min(moe.moe_imbalance_factor, moe.num_experts / moe.moe_router_topk)
        bound = "imbalance"
    else:
        factor, bound = moe.num_experts / moe.moe_router_topk, "worst"
    probed = dataclasses.replace(
        moe,
        moe_expert_capacity_factor=factor,
        moe_pad_expert_input_to_capacity=True,
        moe_imbalance_factor=0.0,
    )
    return ExpertsProbe(probed, plan.ep, plan.expert_tp, bound)
