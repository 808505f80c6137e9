"""The pieces of a Megatron step's time on one GPU for one micro-batch: a transformer layer (its
attention block, dense MLP or MoE block, memory-bound kernels, tensor-, context- and
expert-parallel communication, recompute, activation offloading, Megatron-FSDP's per-layer
collectives, host launches), the output layer and loss with the multi-token prediction layers,
and the parameters a GPU holds. Pure Python (the planner calls it for every candidate).

Sizes are per GPU: T = micro-batch x seq / CP tokens, weight dimensions over TP. The primitives
(a GEMM, an HBM pass, a ring collective) are capture_megatron.steptime.kernels; the attention block
capture_megatron.steptime.attention; the MoE block capture_megatron.steptime.moe.
"""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.features.mla import attention_parameters
from capture_megatron.steptime import attention as at
from capture_megatron.steptime import fsdp, launch
from capture_megatron.steptime import moe as mo
from capture_megatron.steptime.attention import TpBlock, cp_comm, tp_comm
from capture_megatron.steptime.attention import core as attention
from capture_megatron.steptime.kernels import (
    LayerTime,
    Parts,
    Setting,
    gemm,
    hbm,
    ring,
    sequence_tokens,
    tokens,
)

__all__ = [
    "LayerTime",
    "Parts",
    "Setting",
    "attention",
    "cp_comm",
    "gemm",
    "head",
    "head_time",
    "layer_params",
    "layer_time",
    "ring",
    "sequence_tokens",
    "tokens",
]


def mlp_gemms(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(forward seconds of a dense layer's two MLP GEMMs, of its column-parallel one)."""
    n_tok, t, h, up = tokens(shape, plan), plan.tp, shape.hidden_size, 2 if shape.gated else 1
    fc1 = gemm(s, n_tok, up * shape.ffn / t, h)
    return fc1 + gemm(s, n_tok, h, shape.ffn / t), fc1


def mlp_activation(s: Setting, shape: ModelShape, plan: ParallelPlan) -> float:
    """Forward seconds of a dense MLP's activation: three passes over its first projection's
    output."""
    width = shape.ffn / plan.tp * (2 if shape.gated else 1)
    return hbm(s, dtype_bytes(shape.dtype) * 3 * tokens(shape, plan) * width)


def elementwise(s: Setting, shape: ModelShape, plan: ParallelPlan) -> float:
    """Forward seconds of a layer's memory-bound kernels on the hidden states: norms, RoPE,
    dropout and residual adds (elementwise_passes reads or writes of each hidden-size activation,
    on 1 / TP of the tokens with sequence parallelism; the backward twice)."""
    hidden = sequence_tokens(shape, plan) * shape.hidden_size
    passes = s.k.elementwise_passes + (2 if shape.hidden_dropout else 0)  # dropout masks
    return hbm(s, dtype_bytes(shape.dtype) * passes * hidden)


def unfused_wgrad(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> float:
    """Backward seconds of adding a layer's weight gradients into the fp32 main gradients when
    they are not accumulated in place (--no-gradient-accumulation-fusion): each 16-bit gradient
    written, read back, and the main gradient read and written."""
    if s.run.gradient_accumulation_fusion:
        return 0.0
    dense, expert = layer_param_split(shape, plan, moe)
    return hbm(s, (dense + expert) * (2 + 2 + 4 + 4))


def _layer(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> LayerTime:
    """One layer's kernels and communication, before offloading, FSDP and launches."""
    attn_core = attention(s, shape, plan)
    lin, _ = at.linear(s, shape, plan)
    cpc = cp_comm(s, shape, plan, attn_core)
    elem = elementwise(s, shape, plan)
    blocks: list[TpBlock] = [at.block(s, shape, plan)]
    dispatch = ep = (0.0, 0.0)
    etp = 0.0
    if moe:
        m = mo.block(s, shape, plan)
        attn = (  # the merged schedule's attention node: with the norms, router and permute
            lin + attn_core[0] + elem + m.router + m.permute,
            2 * (lin + elem + m.router) + attn_core[1] + m.permute,
        )
        ep_f, ep_b, shared_hidden = mo.exposed(s, shape, plan, m, attn)
        if m.shared_tp is not None and not shared_hidden:
            blocks.append(m.shared_tp)
        fwd_mlp = m.experts + m.shared
        dispatch = (m.router + m.permute, 2 * m.router + m.permute)
        ep, etp = (ep_f, ep_b), m.expert_tp
    else:
        gemms, column = mlp_gemms(s, shape, plan)
        fwd_mlp = gemms + mlp_activation(s, shape, plan)
        blocks.append(TpBlock(blocks[0].scattered, blocks[0].scattered, column))
    tp = tp_comm(s, plan, blocks)
    compute_f = lin + attn_core[0] + elem + fwd_mlp
    compute_b = 2 * (lin + elem + fwd_mlp) + attn_core[1] + unfused_wgrad(s, shape, plan, moe)
    parts = Parts(
        compute=compute_f + compute_b,
        tp=tp[0] + tp[1] + 2 * etp,
        cp=cpc[0] + cpc[1],
        ep=ep[0] + ep[1],
        dispatch=dispatch[0] + dispatch[1],
    )
    fwd = compute_f + tp[0] + etp + cpc[0] + ep[0] + dispatch[0]
    return LayerTime(fwd, parts.total - fwd, 0.0, parts)


_LAYER_TIMES: dict[tuple, LayerTime] = {}
"""layer_time's answers by _layer_key (the planner asks for the same layer of many candidates)."""
MEMO_LIMIT = 100_000
"""Entries a memo of this module keeps at most (then it starts again)."""


def _layer_key(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> tuple:
    """What a layer's time depends on: the plan's fields besides those no piece of it reads (PP,
    VPP, the layout, the global batch, the micro-batch group, the per-stage recompute counts:
    a layer's time is the same on every stage)."""
    rc = plan.recompute
    return (s, shape, moe, plan.tp, plan.dp, plan.micro_batch_size, plan.cp, plan.ep, plan.etp,
            plan.cp_comm_type, rc.granularity, rc.method, rc.modules, plan.sequence_parallel,
            plan.distributed_optimizer, plan.mtp_layers, plan.ddp)  # fmt: skip


def layer_time(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool = False) -> LayerTime:
    """One transformer layer's forward and backward on one GPU for one micro-batch: its kernels
    and the communication they leave exposed, the fine-grained activation offloading transfers
    its compute does not hide, Megatron-FSDP's per-layer collectives its compute does not hide,
    the host launches its kernels do not hide, and the forward selective recompute runs again
    (memoised: _layer_key)."""
    key = _layer_key(s, shape, plan, moe)
    found = _LAYER_TIMES.get(key)
    if found is None:
        if len(_LAYER_TIMES) >= MEMO_LIMIT:
            _LAYER_TIMES.clear()
        found = _LAYER_TIMES[key] = _layer_time(s, shape, plan, moe)
    return found


def _layer_time(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> LayerTime:
    """layer_time, computed."""
    base = _layer(s, shape, plan, moe)
    fwd, bwd = base.forward, base.backward
    moved = offloaded_bytes(shape, plan, moe) / s.hw.host_bytes_per_s
    offload = (max(moved - fwd, 0.0), max(moved - bwd, 0.0))
    compute = (base.parts.compute * fwd / (fwd + bwd), base.parts.compute * bwd / (fwd + bwd))
    dp = fsdp.per_layer(s, shape, plan, layer_param_split(shape, plan, moe), compute)
    host = launch.host_bound(fwd, bwd, launch.host_seconds(s, shape, plan, moe))
    parts = base.parts + Parts(
        offload=offload[0] + offload[1], overhead=host[0] + host[1], dp=dp[0] + dp[1]
    )
    fwd += offload[0] + host[0] + dp[0]
    bwd += offload[1] + host[1] + dp[1]
    return LayerTime(fwd, bwd, recomputed(s, shape, plan, moe), parts)


def offloaded_bytes(shape: ModelShape, plan: ParallelPlan, moe: bool) -> float:
    """Bytes one layer's --offload-modules groups move to the host per micro-batch on one GPU
    (fine-grained activation offloading; 0 when off), each group's input as megatron-core 0.16.1
    saves it: the hidden states for attn_norm, qkv_linear and mlp_norm (1 / TP of the tokens with
    sequence parallelism); the attention core's query, key, value and output for core_attn (which
    attn_proj's input, the output, shares); an MoE layer's routed tokens (top-k copies) for
    expert_fc1 and its first projection's output for moe_act. Copied once each way, D2H in the
    forward and H2D before the backward, on streams of their own (megatron-core's
    fine_grained_activation_offload.py), so only what exceeds the layer's compute shows
    (layer_time). An estimate from the shape: the memory forecast uses the measured tensors
    (ProfileRecord.offload_tensors)."""
    groups = set(plan.ddp.activation_offload.groups)
    if not groups:
        return 0.0
    n_tok, t, b = tokens(shape, plan), plan.tp, dtype_bytes(shape.dtype)
    hidden = sequence_tokens(shape, plan) * shape.hidden_size * b
    total = hidden * len(groups & {"attn_norm", "qkv_linear", "mlp_norm"})
    if "core_attn" in groups:
        a, mla = shape.num_attention_heads, shape.mla
        if mla.enabled:
            widths = a * (2 * mla.q_head_dim + 2 * mla.v_head_dim)
        else:
            widths = (2 * a + 2 * shape.groups) * shape.head_dim
        total += n_tok * widths / t * b
    if moe:
        routed = sequence_tokens(shape, plan) * shape.moe.moe_router_topk
        up = 2 if shape.gated else 1
        total += routed * shape.hidden_size * b if "expert_fc1" in groups else 0.0
        total += routed * up * shape.moe_ffn / plan.expert_tp * b if "moe_act" in groups else 0.0
    return total


def recomputed(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> float:
    """Forward seconds selective recompute runs again in one layer's backward: each module of
    --recompute-modules that megatron-core 0.16.1 checkpoints in this kind of layer, priced as
    the same pieces of the forward. core_attn: the attention core; mlp (dense layers): the MLP's
    GEMMs, its activation and its TP collectives; moe (MoE layers): the whole expert block, its
    router, permutes, dispatch and combine, experts and shared experts; moe_act: the experts'
    activation; shared_experts: the shared experts; layernorm: the two norms (a read and a write
    of the hidden states each); mla_up_proj: MLA's query and key/value up-projections."""
    chosen = plan.recompute.selected
    if not chosen:
        return 0.0
    total = attention(s, shape, plan)[0] if "core_attn" in chosen else 0.0
    if "mlp" in chosen and not moe:
        gemms, column = mlp_gemms(s, shape, plan)
        block = at.block(s, shape, plan)
        comm = tp_comm(s, plan, [TpBlock(block.scattered, block.scattered, column)])[0]
        total += gemms + mlp_activation(s, shape, plan) + comm
    if moe:
        m = mo.block(s, shape, plan)
        if "moe" in chosen:
            total += m.router + m.permute + m.experts + m.shared + m.comm + m.expert_tp
        else:
            total += m.activation if "moe_act" in chosen and shape.moe.moe_grouped_gemm else 0.0
            total += m.shared if "shared_experts" in chosen else 0.0
    if "layernorm" in chosen:
        hidden = sequence_tokens(shape, plan) * shape.hidden_size
        total += hbm(s, 2 * 2 * dtype_bytes(shape.dtype) * hidden)
    if "mla_up_proj" in chosen:
        total += at.up_projections(s, shape, plan)
    return total


def _output(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer and cross entropy (fp32 logits written and
    read back in each direction)."""
    n_tok, vocab = tokens(shape, plan), shape.padded_vocab(plan.tp) / plan.tp
    out = gemm(s, n_tok, vocab, shape.hidden_size)
    loss = hbm(s, 4 * 4 * n_tok * vocab)
    return out + loss, 2 * out + loss


def head(s: Setting, shape: ModelShape, plan: ParallelPlan) -> LayerTime:
    """The last stage's work after its transformer layers: the final norm, output layer and cross
    entropy, and each multi-token prediction layer (megatron-core 0.16.1
    multi_token_prediction.py: two norms, the eh_proj projection of the concatenated embedding
    and hidden states, a transformer layer of the decoder's last kind, its own output layer and
    loss); recompute inside the MTP layers as the plan says."""
    fwd, bwd = _output(s, shape, plan)
    parts = Parts(compute=fwd + bwd)
    redo = 0.0
    if plan.mtp_layers:
        moe = bool(shape.moe.enabled and shape.moe_layers[-1])
        layer = layer_time(s, shape, plan, moe)
        h, n_tok = shape.hidden_size, tokens(shape, plan)
        proj = gemm(s, n_tok, h / plan.tp, 2 * h) + hbm(
            s, 2 * 2 * dtype_bytes(shape.dtype) * sequence_tokens(shape, plan) * h
        )
        selective = plan.recompute.granularity == "selective"
        redo = layer.recomputed_forward if selective else 0.0
        one = Parts(compute=fwd + bwd + 3 * proj, recompute=redo) + layer.parts
        parts = parts + one.scaled(plan.mtp_layers)
        fwd += plan.mtp_layers * (fwd + proj + layer.forward)
        bwd += plan.mtp_layers * (bwd + 2 * proj + layer.backward + redo)
    return LayerTime(fwd, bwd, 0.0, parts)


def head_time(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(forward, backward) seconds of the last stage's work after its transformer layers
    (`head`)."""
    key = _layer_key(s, shape, plan, False) + ("head",)
    found = _HEAD_TIMES.get(key)
    if found is None:
        if len(_HEAD_TIMES) >= MEMO_LIMIT:
            _HEAD_TIMES.clear()
        h = head(s, shape, plan)
        found = _HEAD_TIMES[key] = (h.forward, h.backward)
    return found


_HEAD_TIMES: dict[tuple, tuple[float, float]] = {}
"""head_time's answers by _layer_key (the head is one stage's, whichever it is)."""


def expert_params(shape: ModelShape, plan: ParallelPlan) -> float:
    """Routed-expert parameters of one MoE layer held by one GPU (over EP and the expert TP)."""
    up = 2 if shape.gated else 1
    per = shape.hidden_size * shape.moe_ffn * (up + 1) / plan.expert_tp
    return shape.moe.num_experts / plan.ep * per


def layer_param_split(shape: ModelShape, plan: ParallelPlan, moe: bool) -> tuple[float, float]:
    """(parameters reduced over DP x CP, routed-expert parameters reduced over the expert-data-
    parallel group) of one layer on one GPU."""
    if not moe:
        return layer_params(shape, plan.tp), 0.0
    routed = expert_params(shape, plan)
    rest = layer_params(shape, plan.tp, True, plan.ep) - routed_params(shape, plan.tp, plan.ep)
    return rest, routed


def routed_params(shape: ModelShape, tp: int, ep: int) -> float:
    """Routed-expert parameters of one MoE layer held by one GPU (over EP and the expert TP,
    taken as TP: a lower count where the expert TP is smaller)."""
    up = 2 if shape.gated else 1
    return shape.moe.num_experts / ep * shape.hidden_size * shape.moe_ffn * (up + 1) / tp


def layer_params(shape: ModelShape, tp: int, moe: bool = False, ep: int = 1) -> float:
    """Parameters of one transformer layer held by one GPU: the attention as megatron-core builds
    it (config.attention.attention_parameters: GQA, QK norms, MLA's latent projections), the MLP
    over TP, routed experts over EP and the expert TP (taken as TP), norms and biases included."""
    h = shape.hidden_size
    up = 2 if shape.gated else 1
    attn = attention_parameters(shape, tp)
    norms = 2 * h
    if not moe:
        bias = up * shape.ffn / tp + h if shape.add_bias_linear else 0
        return attn + h * shape.ffn * (up + 1) / tp + bias + norms
    m = shape.moe
    shared = h * m.moe_shared_expert_intermediate_size * (up + 1)
    return attn + routed_params(shape, tp, ep) + shared / tp + norms + m.num_experts * h


def end_params(shape: ModelShape, tp: int, first: bool, last: bool) -> float:
    """Embedding (first stage: word and learned position tables) and output-layer (last stage:
    final norm, untied output weights) parameters on one GPU."""
    vocab_h = shape.padded_vocab(tp) / tp * shape.hidden_size
    total = 0.0
    if first:
        total += vocab_h
        if shape.position_embedding_type == "learned_absolute":
            total += shape.max_positions * shape.hidden_size
    if last:
        total += shape.hidden_size
        if shape.untie_embeddings_and_output_weights or not first:
            total += vocab_h
    return total
