"""Transformer Engine's userbuffers for --tp-comm-overlap: what Megatron-LM has TE allocate on every
GPU, per token (capture_megatron.config.kernels.Kernels.userbuffer_bytes_per_token reads it). Pure
Python."""

from __future__ import annotations

UB_ALL_GATHER: tuple[str, ...] = ("qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad")
UB_ALL_GATHER += ("fc1_fprop", "fc1_dgrad", "fc2_dgrad", "fc2_wgrad")
"""Userbuffers TE keeps in the GEMMs' input precision (1 byte when the linear layers compute in a
1-byte format; initialize_ub's layers_all_gather_overlap)."""
UB_LAYERS = UB_ALL_GATHER + ("proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad")
"""Every userbuffer initialize_ub allocates with the default methods (ring_exchange: qkv_fprop,
fc1_fprop, proj_dgrad, fc2_dgrad; pipeline: proj_fprop, fc2_fprop; bulk: qkv / fc1 dgrad and
wgrad; external: proj_wgrad, fc2_wgrad)."""


def userbuffer_bytes_per_token(hidden_size: int, gathered_bytes: int = 2) -> int:
    """Bytes per token of the userbuffers Megatron-LM's _initialize_tp_communicators has TE's
    initialize_ub allocate on every GPU for --tp-comm-overlap (MC training/initialize.py:242-313;
    TE module/base.py initialize_ub): one [seq x micro-batch / CP, hidden] buffer per layer of
    UB_LAYERS (the default methods make every ring-exchange buffer an all-gather one, which holds
    the full shape, comm_gemm_overlap.cpp:672-695), bf16, the all-gather buffers of `gathered_bytes`
    per element (Kernels.gemm_input_bytes: 1 in a 1-byte format). They come from cuMemCreate /
    cudaMalloc (userbuffers-host.cpp register_user_buffer_collective), outside torch's caching
    allocator: not in max_memory_allocated, but on the GPU."""
    return sum(hidden_size * (gathered_bytes if name in UB_ALL_GATHER else 2) for name in UB_LAYERS)
