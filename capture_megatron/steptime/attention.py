"""The attention block's time on one GPU for one micro-batch: its linear layers (standard QKV or
multi-latent attention's low-rank projections, as megatron-core 0.16.1 builds them), the attention
core, and what its tensor- and context-parallel communication moves. Pure Python.

Multi-latent attention (megatron-core 0.16.1 multi_latent_attention.py, Transformer Engine spec):
the query and key/value down-projections are `duplicated` linear layers (not split over TP) run
on the sequence-parallel share of the tokens; the compressed query, key/value latent and the
rotary key part are then gathered over TP (not the hidden states), and the up-projections are
column-parallel over the heads; the core attends with query / key heads of qk_head_dim +
qk_pos_emb_head_dim and value heads of v_head_dim; the output projection is row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.steptime.kernels import (
    Setting,
    gemm,
    hbm,
    ring,
    sequence_tokens,
    tokens,
)


@dataclass(frozen=True)
class TpBlock:
    """One tensor-parallel block of a layer (attention, a dense MLP, the shared experts): what its
    sequence-parallel gather and scatter move and the column-parallel GEMMs the backward's
    collectives can overlap."""

    gathered: float
    """Bytes of the whole tensor gathered before the column-parallel GEMMs (all TP ranks'
    tokens); with sequence parallelism an all-gather, without it the backward's all-reduce of the
    input gradient."""
    scattered: float
    """Bytes of the row-parallel output (all tokens): a reduce-scatter with sequence parallelism,
    an all-reduce without."""
    column: float
    """Forward seconds of the block's column-parallel GEMMs (their weight-gradient GEMMs run while
    the backward's input-gradient collectives do)."""


def head_dims(shape: ModelShape) -> tuple[int, int]:
    """(query / key, value) width of one attention head: MLA's qk_head_dim + qk_pos_emb_head_dim
    and v_head_dim, else the head dimension for both."""
    mla = shape.mla
    if mla.enabled:
        return mla.qk_head_dim + mla.qk_pos_emb_head_dim, mla.v_head_dim
    return shape.head_dim, shape.head_dim


def linear(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(forward seconds of the attention block's linear layers, of its column-parallel ones)."""
    t, n_tok, h = plan.tp, tokens(shape, plan), shape.hidden_size
    a, mla = shape.num_attention_heads, shape.mla
    if not mla.enabled:
        g, d = shape.groups, shape.head_dim
        qkv = gemm(s, n_tok, (a + 2 * g) * d / t, h)
        return qkv + gemm(s, n_tok, h, a * d / t), qkv
    qk, v = head_dims(shape)
    local = sequence_tokens(shape, plan)  # the duplicated down-projections: SP-local tokens
    down = gemm(s, local, mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h)
    if mla.q_lora_rank:
        down += gemm(s, local, mla.q_lora_rank, h)
        column = gemm(s, n_tok, a * qk / t, mla.q_lora_rank)
    else:
        column = gemm(s, n_tok, a * qk / t, h)
    column += gemm(s, n_tok, a * (mla.qk_head_dim + v) / t, mla.kv_lora_rank)
    return down + column + gemm(s, n_tok, h, a * v / t), column


def up_projections(s: Setting, shape: ModelShape, plan: ParallelPlan) -> float:
    """Forward seconds of MLA's query and key/value up-projections (what --recompute-modules
    mla_up_proj re-runs; 0 without MLA)."""
    mla = shape.mla
    if not mla.enabled:
        return 0.0
    n_tok, a = tokens(shape, plan), shape.num_attention_heads / plan.tp
    qk, v = head_dims(shape)
    up = gemm(s, n_tok, a * qk, mla.q_lora_rank) if mla.q_lora_rank else 0.0
    return up + gemm(s, n_tok, a * (mla.qk_head_dim + v), mla.kv_lora_rank)


def block(s: Setting, shape: ModelShape, plan: ParallelPlan) -> TpBlock:
    """The attention block's tensor-parallel traffic: what is gathered before the column-parallel
    GEMMs (the hidden states; with MLA its compressed query, key/value latent and rotary key) and
    the output projection's result."""
    n_tok, h, b = tokens(shape, plan), shape.hidden_size, dtype_bytes(shape.dtype)
    mla = shape.mla
    width = float(h)
    if mla.enabled and plan.sequence_parallel:
        width = (mla.q_lora_rank or h) + mla.kv_lora_rank + mla.qk_pos_emb_head_dim
    return TpBlock(n_tok * width * b, n_tok * h * b, linear(s, shape, plan)[1])


def core(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core. Fused (flash / cuDNN): the causal half of
    the s x s work, backward 2.5 x the forward's FLOPs, at attention_efficiency. Unfused: both
    batched GEMMs over the whole s x s plus the scores' softmax, mask and dropout through HBM."""
    heads = shape.num_attention_heads / plan.tp
    b, n_tok = plan.micro_batch_size, tokens(shape, plan)
    qk, v = head_dims(shape)
    full = 2 * n_tok * shape.seq_length * heads * (qk + v)  # QK^T and PV, every query vs every key
    if s.run.fused_attention:
        fwd = full / 2 / (s.hw.peak_flops * s.k.attention_efficiency)
        return fwd, 2.5 * fwd * (s.k.deterministic_backward if s.run.deterministic else 1.0)
    scores = b * heads * (n_tok / b) * shape.seq_length
    gemms = full / (s.hw.peak_flops * s.k.gemm_efficiency)
    traffic = hbm(s, scores * 2)
    return gemms + 4 * traffic, 2 * gemms + 6 * traffic


def cp_comm(
    s: Setting, shape: ModelShape, plan: ParallelPlan, attn: tuple[float, float]
) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of context parallelism's K/V ring (TE p2p): each of the
    cp - 1 steps passes this rank's K and V (backward: and their gradients) to the next rank while
    the attention of the current chunk runs; what the attention cannot hide is exposed. The
    a2a / allgather types move the same volume (allgather: every chunk at once). MLA passes its
    per-head keys and values."""
    if plan.cp == 1:
        return 0.0, 0.0
    if shape.mla.enabled:
        qk, v = head_dims(shape)
        kv = tokens(shape, plan) * shape.num_attention_heads * (qk + v) / plan.tp
    else:
        kv = 2 * tokens(shape, plan) * shape.groups * shape.head_dim / plan.tp
    bw = s.hw.link_bytes_per_s(0, plan.cp, plan.tp) * s.k.link_efficiency
    step = kv * dtype_bytes(shape.dtype) / bw
    steps = plan.cp - 1
    fwd = max(0.0, steps * step - attn[0] * steps / plan.cp)
    bwd = max(0.0, 2 * steps * step - attn[1] * steps / plan.cp)
    return fwd, bwd


def tp_comm(s: Setting, plan: ParallelPlan, blocks: list[TpBlock]) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of a layer's tensor-parallel collectives over its
    `blocks`. Forward: each block's row-parallel output all-reduce (with SP its input all-gather
    and output reduce-scatter), all exposed. Backward (Transformer Engine's linear layers): the
    column-parallel input gradients' all-reduces (with SP their reduce-scatters, and the inputs'
    all-gathers for the weight gradients) run while the weight-gradient GEMMs do; with SP the
    row-parallel layers' output-gradient all-gathers are exposed. Under --tp-comm-overlap the
    fraction tp_overlap_exposed of every collective is left."""
    if plan.tp == 1 or not blocks:
        return 0.0, 0.0
    t = plan.tp
    bw = s.hw.link_bytes_per_s(0, t, 1)
    gathered = sum(ring(s, x.gathered, t, bw) for x in blocks)
    scattered = sum(ring(s, x.scattered, t, bw) for x in blocks)
    column = sum(x.column for x in blocks)
    if s.run.tp_comm_overlap:
        left = (gathered + scattered) * s.k.tp_overlap_exposed
        return left, left
    if plan.sequence_parallel:
        return gathered + scattered, scattered + max(0.0, 2 * gathered - 2 * column)
    return 2 * scattered, max(0.0, 2 * gathered - column)
