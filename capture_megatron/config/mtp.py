"""What a plan must respect for a model with multi-token prediction (--mtp-num-layers), as
megatron-core 0.16.1 places and runs the MTP layers and as the memory model covers them (pure
Python; no torch import here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capture_megatron.config.model import ModelShape
    from capture_megatron.config.parallel import ParallelPlan


def mtp_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """Why `plan` cannot run `shape`'s multi-token prediction layers as modelled (empty: it can):
    the plan must place the model's MTP layers; megatron-core asserts uniform recompute of one
    layer at a time on their stage, and then recomputes them (the probes recompute by the block
    method, under which megatron-core keeps the MTP layers' activations); a last stage without
    decoder layers moves the final norm to the stage before, and context parallelism shifts MTP's
    tokens across CP ranks (neither modelled)."""
    mtp = shape.mtp_num_layers
    p = []
    if plan.mtp_layers != mtp:
        p.append(f"the plan places {plan.mtp_layers} MTP layers but --mtp-num-layers is {mtp}")
    if not mtp:
        return p
    if plan.recompute.granularity == "full" and plan.recompute.method == "uniform":
        p.append(
            "--recompute-method uniform with --mtp-num-layers: megatron-core then recomputes the "
            "MTP layers too (and asserts --recompute-num-layers 1), which is not modelled; use "
            "--recompute-method block, under which it keeps their activations"
        )
    if plan.pp > 1 and plan.layers_per_stage[-1] == 0:
        p.append(
            "a last pipeline stage without transformer layers with --mtp-num-layers is not "
            "modelled (megatron-core then puts the decoder's final norm on the stage before); "
            "give the last stage at least one transformer layer"
        )
    if plan.cp > 1:
        p.append(
            f"--context-parallel-size {plan.cp} with --mtp-num-layers is not modelled (MTP shifts "
            "tokens across the CP ranks); leave context parallelism out"
        )
    return p
