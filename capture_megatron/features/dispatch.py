"""The flex token dispatcher (--moe-token-dispatcher-type flex): megatron-core 0.16.1's rules, and
the communication buffers HybridEP allocates outside the caching allocator (pure Python).

megatron-core 0.16.1 (transformer/moe/token_dispatcher.py MoEFlexTokenDispatcher, fused_a2a.py)
sends a flex layer's tokens through DeepEP's `Buffer` (--moe-flex-dispatcher-backend deepep, the
default) or NVIDIA's `HybridEPBuffer` (hybridep), both from deepseek-ai/DeepEP's hybrid-ep branch,
which Megatron-LM core_v0.16.1 pins at eb9cee7de5a24193bf09500668d3a619d3d3f3fb
(docker/Dockerfile.ci.dev). The GPU kernel set runs HybridEP through an emulation of its Python
API (capture_megatron.emulate.gpu.flex); DeepEP is refused (DEEPEP_REFUSAL).

HybridEP's own buffers (csrc/hybrid_ep/hybrid_ep.cu allocate_buffer, internode.cu
allocate_*_rdma_buffers at eb9cee7) come from cudaMalloc / its ExtendedMemoryAllocator, not from
torch: like Transformer Engine's userbuffers they are counted in what a GPU needs
(capture_megatron.planner.margins), not in the allocator peak. megatron-core sizes them with
init_hybrid_ep_buffer(hidden_dim, seq_len = the tokens of the layer's input on this rank,
num_local_experts), the first time a flex layer dispatches.
"""

from __future__ import annotations

MIN_TOKENS = 512
"""HybridEPBuffer's floor on max_num_of_tokens_per_rank (hybrid_ep_buffer.py:
max(max_num_of_tokens_per_rank, 512))."""
TOKENS_PER_CHUNK = 128
"""NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API / _COMBINE_API's default (the RDMA flags' chunk)."""


def hybridep_buffer_bytes(
    hidden: int, tokens_per_rank: int, tp_ep: int, local_experts: int, nvlink_domain: int
) -> int:
    """Bytes of HybridEP's communication buffers on each GPU, outside the caching allocator, for
    bf16 / fp16 tokens (megatron-core never dispatches FP8: init_hybrid_ep_buffer asserts
    fp8_dispatch off), with DeepEP eb9cee7's defaults (use_shared_buffer: the dispatch output
    shares the combine input). M = max(tokens, 512) x group is the worst case: every token of the
    group routed to one rank.

    - NVLink domain (hybrid_ep.cu allocate_buffer_for_combine / _for_dispatch): the expert
      token buffer [M, hidden] uint16, probabilities [M, local experts x ranks per domain]
      float32, FP8 scaling factors [M, hidden / 128] float32 (allocated whatever the dtype);
    - across nodes (internode.cu allocate_dispatch_rdma_buffers / allocate_combine_rdma_buffers,
      nodes N > 1), per max tokens T: the attention-side input [T, hidden] uint16, [T, experts]
      and [T, hidden / 128] float32; dispatch's inter-node group [T x (N - 1), hidden] uint16,
      [T x (N - 1), local experts x ranks per domain] and [T x (N - 1), hidden / 128] float32;
      combine's intra-node reduction and inter-node group, each [T x (N - 1), hidden] uint16 and
      [T x (N - 1), local experts x ranks per domain] float32; and 4 flag arrays of
      ceil(T / 128) x (N - 1) uint64.
    A few flag words and the preprocessing kernel's block states (108 x ranks per domain) are
    left out (under a MiB)."""
    t = max(tokens_per_rank, MIN_TOKENS)
    ranks = min(tp_ep, nvlink_domain)
    nodes = tp_ep // ranks
    probs = local_experts * ranks
    scales = hidden // 128
    m = t * tp_ep
    total = m * (2 * hidden + 4 * probs + 4 * scales)
    if nodes > 1:
        other = t * (nodes - 1)
        total += t * (2 * hidden + 4 * local_experts * tp_ep + 4 * scales)
        total += other * (2 * hidden + 4 * probs + 4 * scales)
        total += 2 * other * (2 * hidden + 4 * probs)
        total += 4 * -(-t // TOKENS_PER_CHUNK) * (nodes - 1) * 8
    return total
