"""Which context-parallel attention algorithm a run may ask for (--cp-comm-type), pure Python.

With Transformer Engine (a GPU), TEDotProductAttention runs p2p (ring), a2a (all-to-all),
all_gather or a2a+p2p itself. Without it (the CPU kernel set; the local spec on a GPU) the core
attention is capture-megatron's all-gather one (capture_megatron.emulate.cp_attention), which runs
only 'allgather' (or the flag left out). The GPU kernel set (the fake-cuda device) emulates TE's
ring attention (p2p) with its flash or fused backend; a run's other choices are refused by
context_problem, never forecast as the modelled one.
"""

from __future__ import annotations

from capture_megatron.config.parallel import ParallelPlan
from capture_megatron.errors import CaptureError

ALL_GATHER = ("", "allgather")
"""--cp-comm-type values the all-gather attention runs ('' when the flag is not given)."""


def check_comm_type(plan: ParallelPlan, uses_te: bool) -> None:
    """CaptureError when --cp-comm-type asks for what this run's attention cannot do.

    `uses_te`: the run builds Transformer Engine's attention (a GPU with TE), which does p2p, a2a
    and allgather itself; a2a+p2p also needs Megatron-LM's --hierarchical-context-parallel-sizes,
    which capture-megatron does not take."""
    kind = plan.cp_comm_type
    if plan.cp == 1 or kind in ALL_GATHER or (uses_te and kind != "a2a+p2p"):
        return
    if uses_te:
        raise CaptureError(
            f"--cp-comm-type {kind}: Megatron-LM's hierarchical context parallelism needs "
            "--hierarchical-context-parallel-sizes, which capture-megatron does not support; "
            "give --cp-comm-type p2p, a2a or allgather"
        )
    raise CaptureError(
        f"--cp-comm-type {kind} with --context-parallel-size {plan.cp}: this run has no "
        "Transformer Engine (the CPU kernel set, or the local spec), so its context-parallel "
        "attention is capture-megatron's all-gather one, which all-gathers K and V over the "
        "CP group; p2p (ring), a2a (all-to-all) and a2a+p2p are Transformer Engine's "
        "algorithms and run on a GPU with --transformer-impl transformer_engine. Give "
        "--cp-comm-type allgather or leave the flag out"
    )


def te_comm_type(plan: ParallelPlan, uses_te: bool) -> str | None:
    """TransformerConfig.cp_comm_type: with TE and CP > 1, --cp-comm-type (Megatron-LM's default
    p2p when not given; 'allgather' under TE's name 'all_gather', the only name TE's
    attn_forward_func_with_cp accepts); None otherwise (the all-gather attention needs none)."""
    if not uses_te or plan.cp == 1:
        return None
    kind = plan.cp_comm_type or "p2p"
    return "all_gather" if kind == "allgather" else kind
