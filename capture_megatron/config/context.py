"""Which context-parallel attention algorithm a run may ask for (--cp-comm-type), pure Python.

With Transformer Engine (a GPU), TEDotProductAttention runs p2p (ring), a2a (all-to-all),
all_gather or a2a+p2p itself. Without it (the CPU kernel set; the local spec on a GPU) the core
attention is capture-megatron's all-gather one (capture_megatron.emulate.cp_attention), which runs
only 'allgather' (or the flag left out). The GPU kernel set (the fake-cuda device) emulates TE's
ring attention (p2p) with its flash or fused backend; a run's other choices are refused by
context_problem, never forecast as the modelled one.
"""

from __future__ import annotations

from capture_megatron.config.kernels import TE_FUSED_BACKENDS, Kernels
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


RING = ("", "p2p")
"""--cp-comm-type values the GPU kernel set models ('' when not given: Megatron-LM's p2p)."""


def context_problem(cps: tuple[int, ...], comm_type: str, kernel_set: str, kernels: Kernels) -> str:
    """Why context parallelism at the sizes `cps` with --cp-comm-type `comm_type` is not
    modelled on `kernel_set` under `kernels`; '' when it is (or no size is above 1)."""
    if max(cps, default=1) == 1:
        return ""
    if not kernel_set.startswith("gpu"):
        if comm_type in ALL_GATHER:
            return ""
        return (
            f"--cp-comm-type {comm_type} is not modelled: the CPU kernel set's context-parallel "
            "attention all-gathers K and V; give --cp-comm-type allgather or leave the flag out"
        )
    gpu = kernels.for_gpu()
    te = gpu.transformer_impl == "transformer_engine"
    if not (te and gpu.attention_backend in TE_FUSED_BACKENDS):
        return (
            f"--context-parallel-size {max(cps)} with --transformer-impl {gpu.transformer_impl} "
            f"--attention-backend {gpu.attention_backend} is not modelled: Megatron's local "
            "attention and Transformer Engine's unfused backend do not run context parallelism; "
            "use --transformer-impl transformer_engine with --attention-backend flash, fused or "
            "auto"
        )
    if comm_type in RING:
        return ""
    return (
        f"--cp-comm-type {comm_type} is not modelled: the GPU memory model emulates Transformer "
        "Engine's ring context-parallel attention (p2p, Megatron-LM's default) only; give "
        "--cp-comm-type p2p or leave the flag out"
    )
