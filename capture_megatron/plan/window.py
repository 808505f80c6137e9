"""Whether a model's sliding window (--window-size) and its context-parallel attention
(--cp-comm-type) are modelled under the run's kernels (pure Python).

The cpu kernel set builds the window: the local spec's unfused softmax makes its [s, s] mask each
forward, and the profiler measures it. The GPU kernel set models Transformer Engine's flash and
cuDNN fused attention, which take the window as a kernel argument and keep nothing for it; it does
not emulate the masks TE's unfused attention or the local spec's softmax build for a window, so a
model with a window is refused with those kernels, never planned as if it had none.

Context parallelism: the cpu kernel set runs capture-megatron's all-gather attention
(allgather); the GPU kernel set emulates Transformer Engine's ring attention (p2p, Megatron-LM's
default) with its flash or fused backend. Another --cp-comm-type is refused, never planned as
the modelled one.
"""

from __future__ import annotations

from capture_megatron.config import Kernels, ModelShape
from capture_megatron.config.context import ALL_GATHER
from capture_megatron.config.kernels import TE_FUSED_BACKENDS


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
