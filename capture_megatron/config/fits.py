"""Whether a parallel plan can run a model in Megatron: check_plan_fits_model, every rule between
a ModelShape and a ParallelPlan in one place. Pure Python: no torch import here.

A module of its own, above config/parallel.py: the per-feature rules it gathers (mtp, overlap,
recompute) read a ParallelPlan, so parallel.py, which defines it, cannot import them.
"""

from __future__ import annotations

from capture_megatron.config.model import ModelShape, tp_head_problems
from capture_megatron.config.mtp import mtp_problems
from capture_megatron.config.overlap import moe_overlap_problems
from capture_megatron.config.parallel import ParallelPlan, context_problems, expert_problems
from capture_megatron.config.recompute import module_problems
from capture_megatron.errors import require


def check_plan_fits_model(shape: ModelShape, plan: ParallelPlan) -> None:
    """Raise a CaptureError naming every way `plan` cannot run `shape` in Megatron."""
    p = tp_head_problems(shape.num_attention_heads, shape.groups, plan.tp)
    if shape.ffn % plan.tp:
        p.append(f"ffn hidden {shape.ffn} not divisible by TP {plan.tp}")
    if plan.num_layers != shape.num_layers:
        p.append(
            f"layout {plan.layout!r} places {plan.num_layers} layers but --num-layers is "
            f"{shape.num_layers}"
        )
    if plan.sequence_parallel and shape.seq_length % plan.tp:
        p.append(
            f"seq length {shape.seq_length} not divisible by TP {plan.tp} for sequence parallel"
        )
    for r in range(plan.pp):
        for n in plan.chunks_of(r) if plan.recompute.granularity == "full" else ():
            if plan.recompute.method == "uniform" and n % max(plan.recompute.layers_on(r), 1):
                p.append(
                    f"uniform recompute of {plan.recompute.layers_on(r)} does not divide {n} layers"
                )
    p += expert_problems(shape, plan) + context_problems(shape, plan) + mtp_problems(shape, plan)
    p += module_problems(shape, plan.recompute.selected)
    p += plan.ddp.dtype_problems(shape.dtype) + moe_overlap_problems(shape, plan)
    require(p, "plan for this model")
