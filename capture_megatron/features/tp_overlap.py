"""Transformer Engine's userbuffers for --tp-comm-overlap: what Megatron-LM has TE allocate on every
GPU, per token (capture_megatron.config.kernels.Kernels.userbuffer_bytes_per_token reads it). Pure
Python; a module of its own so that kernels.py needs nothing of fp8.py, which reads Kernels."""

from __future__ import annotations

UB_ALL_GATHER: tuple[str, ...] = ("qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad")
UB_ALL_GATHER += ("fc1_fprop", "fc1_dgrad", "fc2_dgrad", "fc2_wgrad")
"""Userbuffers TE keeps in FP8 (uint8) when the run trains in FP8 (initialize_ub's
layers_all_gather_overlap)."""
UB_LAYERS = UB_ALL_GATHER + ("proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad")
"""Every userbuffer initialize_ub allocates with the default methods (ring_exchange: qkv_fprop,
fc1_fprop, proj_dgrad, fc2_dgrad; pipeline: proj_fprop, fc2_fprop; bulk: qkv / fc1 dgrad and
wgrad; external: proj_wgrad, fc2_wgrad)."""


def userbuffer_bytes_per_token(hidden_size: int, fp8: bool) -> int:
    """Bytes per token of the userbuffers Megatron-LM's _initialize_tp_communicators has TE's
    initialize_ub allocate on every GPU for --tp-comm-overlap (MC training/initialize.py:242-313;
    TE module/base.py initialize_ub): one [seq x micro-batch / CP, hidden] buffer per layer of
    UB_LAYERS (the default methods make every ring-exchange buffer an all-gather one, which holds
    the full shape, comm_gemm_overlap.cpp:672-695), bf16, or uint8 for the all-gather buffers in
    FP8 runs. They come from cuMemCreate / cudaMalloc (userbuffers-host.cpp
    register_user_buffer_collective), outside torch's caching allocator: not in
    max_memory_allocated, but on the GPU."""
    return sum(hidden_size * (1 if fp8 and name in UB_ALL_GATHER else 2) for name in UB_LAYERS)
