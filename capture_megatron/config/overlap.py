"""The EP all-to-all overlap (--overlap-moe-expert-parallel-comm): what megatron-core 0.16.1
refuses with it. Pure Python: no torch import here.

Megatron's rules (MC transformer/transformer_config.py:1852-1919, __post_init__): PP > 1 needs
virtual pipeline stages (that rule: DdpOptions.plan_problems);
expert parallelism (EP > 1); the alltoall or flex token dispatcher; no full recompute, no
recompute method or layer count; bf16 or fp16; no --moe-shared-expert-overlap; at most one MTP
layer, and MTP only with PP > 1; CUDA graphs not over the MoE / MLP scopes (CUDA graphs are
refused anyway); --delay-wgrad-compute only with the overlap (refused anyway:
capture_megatron.flags.policy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capture_megatron.config.model import ModelShape
    from capture_megatron.config.parallel import ParallelPlan

_MC = "megatron-core's TransformerConfig"


def moe_overlap_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """Why megatron-core refuses `plan` with --overlap-moe-expert-parallel-comm on `shape`, or
    why the forecast does not cover it (empty: it runs and is forecast, or the flag is off)."""
    if not plan.ddp.overlap_moe_expert_parallel_comm:
        return []
    return _megatron_rules(shape, plan)


def _megatron_rules(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """What megatron-core asserts for the overlap (the flag's name and the rule it breaks)."""
    flag = "--overlap-moe-expert-parallel-comm"
    p = []
    if plan.ep == 1:
        p.append(f"{flag} needs expert parallelism, EP > 1 ({_MC})")
    dispatcher = shape.moe.moe_token_dispatcher_type
    if shape.moe.enabled and dispatcher not in ("alltoall", "flex"):
        p.append(
            f"{flag} needs --moe-token-dispatcher-type alltoall or flex, not {dispatcher} ({_MC})"
        )
    if plan.recompute.granularity == "full":
        p.append(f"{flag} does not allow full recomputation or a recompute method ({_MC})")
    if shape.dtype not in ("bf16", "fp16"):
        p.append(f"{flag} needs --bf16 or --fp16 ({_MC})")
    if shape.mtp_num_layers > 1 or (shape.mtp_num_layers == 1 and plan.pp == 1):
        p.append(f"{flag} allows one MTP layer, and only with PP > 1 ({_MC})")
    return p
