"""What each kernel set, device and memory model describes: a run outside it is refused with the
reason before anything is profiled. Pure Python.

Sliding windows (window_problem): the cpu kernel set builds the window: the local spec's unfused
softmax makes its [s, s] mask each forward, and the profiler measures it. The GPU kernel set models
Transformer Engine's flash and cuDNN fused attention, which take the window as a kernel argument
and keep nothing for it; it does not emulate the masks TE's unfused attention or the local spec's
softmax build for a window, so a model with a window is refused with those kernels, never planned
as if it had none.

Multi-latent attention under the GPU kernels (latent_problem): Transformer Engine's FlashAttention
2 does not run it, megatron-core refuses fused RoPE with plain rope for it, and its context-parallel
attention is not modelled.
"""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.config.context import context_problem
from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.fp8 import fp8_problem
from capture_megatron.config.kernels import TE_FUSED_BACKENDS, Kernels, tp_overlap_problem
from capture_megatron.config.optimizer_offload import fp8_offload_problem
from capture_megatron.errors import CaptureError


def check_request(
    shape: ModelShape,
    kernels: Kernels,
    ddp: DdpOptions,
    cps: tuple[int, ...],
    cp_comm_type: str,
    fixed: ParallelPlan | None,
    kernel_set: str,
) -> None:
    """Refuse FP8, a sliding window or a context-parallel attention the kernels' memory model
    does not hold before profiling (`kernel_set` '': a memory model is given, whose kernel set
    the planner checks), and --optimizer-cpu-offload with FP8 parameters as Megatron-LM does.
    `cps`: the context-parallel sizes searched (or given); `fixed`: the plan, when given."""
    offload = fp8_offload_problem(ddp, kernels.fp8_param_gather, kernels.fp8_recipe)
    if offload:
        raise CaptureError(offload + ".")
    if not kernel_set:
        return
    tp, sp = (fixed.tp, fixed.sequence_parallel) if fixed is not None else (0, True)
    problem = (
        fp8_problem(kernel_set, kernels)
        or tp_overlap_problem(kernel_set, kernels, tp, sp)
        or window_problem(shape, kernel_set, kernels)
        or latent_problem(shape, kernel_set, kernels, max(cps or (1,)))
        or context_problem(cps, cp_comm_type, kernel_set, kernels)
    )
    if problem:
        raise CaptureError(problem + ".")


def window_problem(shape: ModelShape, kernel_set: str, kernels: Kernels) -> str:
    """Why the model's sliding window is not modelled under `kernels` on `kernel_set` ('cpu' or
    'gpu:...', capture_megatron.config.kernels.kernel_set); '' when it is."""
    if not shape.window_size or not kernel_set.startswith("gpu"):
        return ""
    gpu = kernels.for_gpu()
    if gpu.transformer_impl == "transformer_engine" and gpu.attention_backend in TE_FUSED_BACKENDS:
        return ""
    return (
        f"--window-size {','.join(map(str, shape.window_size))} with --transformer-impl "
        f"{gpu.transformer_impl} --attention-backend {gpu.attention_backend}: that unfused "
        "attention builds sliding-window masks the GPU memory model does not hold; use "
        "--transformer-impl transformer_engine with --attention-backend flash, fused or auto, "
        "under which the window changes no memory"
    )


def latent_problem(shape: ModelShape, kernel_set: str, kernels: Kernels, cp: int = 1) -> str:
    """Why the model's multi-latent attention is not modelled (or not run by megatron-core) under
    `kernels` on `kernel_set`; '' when it is."""
    mla = shape.mla
    if not mla.enabled or not kernel_set.startswith("gpu"):
        return ""
    gpu = kernels.for_gpu()
    te = gpu.transformer_impl == "transformer_engine"
    if te and gpu.attention_backend == "flash" and mla.q_head_dim != mla.v_head_dim:
        return (
            "--multi-latent-attention with --attention-backend flash: Transformer Engine's "
            "FlashAttention 2 does not run query/key heads wider than value heads (MLA), and "
            "FlashAttention 3 is not modelled; use --attention-backend fused, auto or unfused"
        )
    rope = shape.position_embedding_type == "rope" and gpu.rope_fusion
    if rope and mla.rope == "rope":
        return (
            "--multi-latent-attention with --rope-type rope and fused RoPE: megatron-core's "
            "MLATransformerConfig refuses it (apply_rope_fusion for MLA only works with YaRN); "
            "give --no-rope-fusion or --rope-type yarn"
        )
    if cp > 1:
        return (
            f"--multi-latent-attention with --context-parallel-size {cp}: Transformer Engine's "
            "context-parallel attention over MLA's unequal head widths is not modelled yet"
        )
    return ""
