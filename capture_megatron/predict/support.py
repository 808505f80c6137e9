"""What the memory forecast covers (pure Python)."""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError


def refuse_unforecast(shape: ModelShape, plan: ParallelPlan) -> None:
    """CaptureError for what the memory model cannot forecast yet: MoE layers, CP > 1."""
    if shape.moe.enabled or plan.cp > 1:
        what = (
            "mixture-of-experts layers"
            if shape.moe.enabled
            else f"context parallelism CP {plan.cp}"
        )
        raise CaptureError(
            f"{what}: capture-megatron trains this, but its memory forecast does not model it "
            "yet; leave out the MoE / --context-parallel-size flags to forecast the dense model"
        )
