"""The flex token dispatcher (--moe-token-dispatcher-type flex): megatron-core 0.16.1's rules, and
the communication buffers HybridEP allocates outside the caching allocator (pure Python).

megatron-core 0.16.1 (transformer/moe/token_dispatcher.py MoEFlexTokenDispatcher, fused_a2a.py)
sends a flex layer's tokens through DeepEP's `Buffer` (--moe-flex-dispatcher-backend deepep, the
default) or NVIDIA's `HybridEPBuffer` (hybridep), both from deepseek-ai/DeepEP's hybrid-ep branch,
which Megatron-LM core_v0.16.1 pins at eb9cee7de5a24193bf09500668d3a619d3d3f3fb
(docker/Dockerfile.ci.dev). The GPU kernel set runs HybridEP through an emulation of its Python
API (capture_megatron.emulate.gpu.flex) and DeepEP through an emulation of its `Buffer`
(capture_megatron.emulate.gpu.deepep).

HybridEP's own buffers (csrc/hybrid_ep/hybrid_ep.cu allocate_buffer, internode.cu
allocate_*_rdma_buffers at eb9cee7) come from cudaMalloc / its ExtendedMemoryAllocator, not from
torch: like Transformer Engine's userbuffers they are counted in what a GPU needs
(capture_megatron.planner.margins), not in the allocator peak. megatron-core sizes them with
init_hybrid_ep_buffer(hidden_dim, seq_len = the tokens of the layer's input on this rank,
num_local_experts), the first time a flex layer dispatches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TOKENS = 512
"""HybridEPBuffer's floor on max_num_of_tokens_per_rank (hybrid_ep_buffer.py:
max(max_num_of_tokens_per_rank, 512))."""
TOKENS_PER_CHUNK = 128
"""NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API / _COMBINE_API's default (the RDMA flags' chunk)."""


def hybridep_buffer_bytes(
    hidden: int, tokens_per_rank: int, tp_ep: int, local_experts: int, nvlink_domain: int
) -> int:
    """Bytes of HybridEP's communication buffers on each GPU, outside the caching allocator, for
    bf16 / fp16 tokens (megatron-core never dispatches quantized tokens: init_hybrid_ep_buffer
    asserts its quantized dispatch off), with DeepEP eb9cee7's defaults (use_shared_buffer: the
    dispatch output shares the combine input). M = max(tokens, 512) x group is the worst case: every
    token of the group routed to one rank.

    - NVLink domain (hybrid_ep.cu allocate_buffer_for_combine / _for_dispatch): the expert
      token buffer [M, hidden] uint16, probabilities [M, local experts x ranks per domain]
      float32, the quantized dispatch's scaling factors [M, hidden / 128] float32 (allocated
      whatever the dtype);
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


# DeepEP (--moe-flex-dispatcher-backend deepep), deep_ep/buffer.py and csrc/config.hpp at eb9cee7.

NVL_PEERS = 8
"""NUM_MAX_NVL_PEERS: DeepEP's NVLink domain (csrc/kernels/configs.cuh)."""
WORKSPACE_BYTES = 32 * 2**20
"""NUM_WORKSPACE_BYTES: the workspace every DeepEP Buffer cudaMallocs (deep_ep.cpp)."""
SOURCE_META_BYTES = 8
"""internode::get_source_meta_bytes(): SourceMeta's two ints."""
MAX_TOPK = 128
"""kNumMaxTopK of the buffer size hints."""
MAX_SCALES = 128
"""kNumMaxScales of the buffer size hints."""
DEEPEP_NUM_SMS = 20
"""Buffer.num_sms's default and megatron-core's moe_deepep_num_sms default."""
DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (8, 288, 32, 128),
    32: (32, 288, 32, 128),
    64: (20, 288, 28, 128),
    128: (20, 560, 32, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
"""Buffer.get_dispatch_config: ranks -> (NVL send, NVL receive, RDMA send, RDMA receive) chunk
tokens."""
COMBINE_CONFIGS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    64: (1, 288, 20, 128),
    128: (1, 560, 12, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}
"""Buffer.get_combine_config, as DISPATCH_CONFIGS."""
DEEPEP_GROUPS = (2, 4, 8, 16, 32, 64, 128, 144, 160)
"""Expert TP x EP groups DeepEP runs: a config above and a kernel instance (intranode 2, 4 or 8
ranks; internode 2, 4, 8, 16, 18 or 20 nodes of 8: csrc/kernels/launch.cuh SWITCH_RANKS,
SWITCH_RDMA_RANKS). 24 ranks have a config but no kernel."""


@dataclass(frozen=True)
class DeepepConfig:
    """DeepEP's Config (csrc/config.hpp): SMs and chunk sizes in tokens."""

    num_sms: int
    """SMs of the normal kernels (two per channel)."""
    nvl_send: int
    """num_max_nvl_chunked_send_tokens."""
    nvl_recv: int
    """num_max_nvl_chunked_recv_tokens."""
    rdma_send: int
    """num_max_rdma_chunked_send_tokens."""
    rdma_recv: int
    """num_max_rdma_chunked_recv_tokens, as given (the constructor aligns it up to rdma_send)."""

    @classmethod
    def of(cls, kind: str, ranks: int, num_sms: int = DEEPEP_NUM_SMS) -> DeepepConfig:
        """Buffer.get_dispatch_config / get_combine_config (`kind` dispatch or combine)."""
        table = DISPATCH_CONFIGS if kind == "dispatch" else COMBINE_CONFIGS
        if ranks not in table:
            raise ValueError(f"Unsupported number of EP ranks: {ranks}")
        return cls(num_sms, *table[ranks])

    @property
    def channels(self) -> int:
        """Channels: two SMs each."""
        return self.num_sms // 2

    def nvl_bytes(self, hidden_bytes: int, ranks: int) -> int:
        """get_nvl_buffer_size_hint: the NVLink buffer (128-byte aligned)."""
        rdma, nvl = max(ranks // NVL_PEERS, 1), min(ranks, NVL_PEERS)
        per_token = hidden_bytes + SOURCE_META_BYTES + MAX_TOPK * (8 + 4) + MAX_SCALES * 4
        n = self.channels * nvl * (2 * rdma + 3) * 4
        n += self.channels * nvl * self.nvl_recv * per_token
        return -(-n // 128) * 128

    def rdma_bytes(self, hidden_bytes: int, ranks: int) -> int:
        """get_rdma_buffer_size_hint: the RDMA (NVSHMEM) buffer, 0 within one NVLink domain."""
        if ranks <= NVL_PEERS:
            return 0
        rdma = ranks // NVL_PEERS
        recv = -(-self.rdma_recv // self.rdma_send) * self.rdma_send
        per_token = hidden_bytes + SOURCE_META_BYTES + MAX_TOPK * (8 + 4) + MAX_SCALES * 4 + 16
        n = self.channels * rdma * (NVL_PEERS * 2 + 2) * 2 * 4
        n += self.channels * rdma * recv * per_token * 2
        return -(-n // 128) * 128


def deepep_buffer_bytes(
    hidden: int, group: int, num_sms: int = DEEPEP_NUM_SMS, element_bytes: int = 2
) -> int:
    """Bytes of DeepEP's Buffer on each GPU, outside the caching allocator: megatron-core's
    fused_a2a.get_buffer takes the larger NVLink and RDMA size hints of the dispatch and combine
    configs for the expert TP x EP `group` and hidden bytes h x max(element, 2); the Buffer
    allocates the NVLink buffer (cudaMalloc, with a few pointers and barrier flags), the RDMA
    buffer (nvshmem_align, only across nodes) and a 32 MiB workspace (deep_ep.cpp
    Buffer::Buffer). NVSHMEM's own heap reserve across nodes is left out (its size is NVSHMEM's
    configuration, not DeepEP's)."""
    hidden_bytes = hidden * max(element_bytes, 2)
    configs = [DeepepConfig.of(k, group, num_sms) for k in ("dispatch", "combine")]
    nvl = max(c.nvl_bytes(hidden_bytes, group) for c in configs)
    rdma = max(c.rdma_bytes(hidden_bytes, group) for c in configs)
    pointers = NVL_PEERS * (4 + 8 + 8) if nvl else 0
    return nvl + pointers + rdma + WORKSPACE_BYTES


@dataclass(frozen=True)
class Received:
    """What one rank receives in a DeepEP dispatch at a routing factor (dropless routing as
    megatron-core's _DeepepManager runs it: no padding)."""

    tokens: int
    """Distinct tokens received (recv_x's rows): each sent once per rank, whatever the number
    of the rank's experts it is routed to."""
    per_expert: tuple[int, ...]
    """Tokens each local expert receives (num_recv_tokens_per_expert_list)."""
    node_tokens: int
    """Across nodes: tokens received over RDMA from this GPU's peers on other nodes, before
    NVLink forwarding (send_nvl_head's rows); 0 within one NVLink domain."""

    @property
    def routed(self) -> int:
        """(token, local expert) pairs: the permuted expert input's rows."""
        return sum(self.per_expert)


def deepep_received(
    tokens: int, group: int, experts: int, topk: int, local: int, factor: float
) -> Received:
    """What a rank of the expert TP x EP `group` receives when each of the group's ranks sends
    `tokens` (a layer's input on a rank) routed to `topk` of `experts` (the model's, before the
    flex dispatcher's TP expansion), `local` experts per rank, every expert at `factor` x its
    balanced share (the routing forecast: the same bound a padded probe pads to, from each
    sending rank min(tokens, ceil(tokens x topk x factor / experts)) per expert, as
    get_capacity). Distinct tokens follow the share of a token's top-k choices that fall on the
    rank's experts together: 1 - C(experts - local, topk) / C(experts, topk) of the tokens hold
    one or more, against topk x local / experts pairs."""
    per_source = min(tokens, math.ceil(tokens * topk * factor / experts))
    pairs = local * per_source
    distinct = _distinct_share(experts, topk, local)
    from_each = min(tokens, math.ceil(pairs * distinct))
    node = 0
    if group > NVL_PEERS:
        node_local = min(experts, local * NVL_PEERS)
        share = _distinct_share(experts, topk, node_local)
        node = (group // NVL_PEERS) * min(tokens, math.ceil(node_local * per_source * share))
    return Received(group * from_each, (group * per_source,) * local, node)


def _distinct_share(experts: int, topk: int, local: int) -> float:
    """Distinct tokens per routed pair on `local` of `experts` experts with top-k routing."""
    pairs = topk * local / experts
    if pairs <= 0:
        return 1.0
    miss = math.comb(experts - local, topk) / math.comb(experts, topk) if experts > local else 0
    return min(1.0, (1 - miss) / pairs)
