"""Model FLOPs of a step as NVIDIA counts them for MFU (3 x the forward; the attention core's full
s x s; the output layer; no recompute), with multi-latent attention's projections, the MoE
layers' top-k and shared experts and router, and the multi-token prediction layers. Pure Python.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from capture_megatron.config import ModelShape
from capture_megatron.steptime.attention import head_dims

__all__ = ["layer_forward_flops", "model_flops"]


def layer_forward_flops(shape: ModelShape, b: int) -> float:
    """Model forward FLOPs of one transformer layer for one micro-batch (whole layer, before TP
    split; the attention core's full s x s, as NVIDIA counts model FLOPs)."""
    s, h, a, g, d, f = (
        shape.seq_length,
        shape.hidden_size,
        shape.num_attention_heads,
        shape.groups,
        shape.head_dim,
        shape.ffn,
    )
    qkv = 2 * b * s * h * (a + 2 * g) * d
    proj = 2 * b * s * a * d * h
    qk, v = head_dims(shape)
    if shape.mla.enabled:  # the latent projections (megatron-core's MLA), no GQA
        mla = shape.mla
        q = h * mla.q_lora_rank + mla.q_lora_rank * a * qk if mla.q_lora_rank else h * a * qk
        kv = h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
        kv += mla.kv_lora_rank * a * (mla.qk_head_dim + v)
        qkv, proj = 2 * b * s * (q + kv), 2 * b * s * a * v * h
    if shape.moe.enabled:  # top-k routed experts and the shared experts per token, the router
        moe = shape.moe
        f = moe.moe_router_topk * shape.moe_ffn + moe.moe_shared_expert_intermediate_size
        proj += 2 * b * s * h * moe.num_experts
    mlp = 2 * b * s * h * f * (3 if shape.gated else 2)
    core = 2 * b * a * s * s * (qk + v)
    return qkv + proj + mlp + core


@functools.lru_cache(maxsize=256)
def model_flops(shape: ModelShape, sequences: int) -> float:
    """Model FLOPs of forward + backward over `sequences` (3 x the forward; output layer
    included; each multi-token prediction layer: a transformer layer of the last kind, its
    projection of the concatenated embedding and hidden states, its output layer)."""
    h, s = shape.hidden_size, shape.seq_length
    head = 2 * s * h * shape.padded_vocab(1)
    pattern = shape.moe_layers if shape.moe.enabled else (False,) * shape.num_layers
    dense = replace(shape, moe=replace(shape.moe, num_experts=0))
    layers = sum(layer_forward_flops(shape if x else dense, 1) for x in pattern)
    mtp = shape.mtp_num_layers * (
        layer_forward_flops(shape if pattern[-1] else dense, 1) + 2 * s * 2 * h * h + head
    )
    return 3 * sequences * (layers + head + mtp)
