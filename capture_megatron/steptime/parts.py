"""The pieces of a Megatron step's time on one GPU for one micro-batch: GEMMs, the attention core,
elementwise kernels, and the tensor-, context- and expert-parallel communication of a layer; the
output layer and loss; collectives over Megatron's rank placement. Pure Python (the planner calls
it for every candidate).

Sizes are per GPU: T = micro-batch x seq / CP tokens, weight dimensions over TP. A GEMM (m x k) @
(k x n) takes 2mnk / (peak x gemm_efficiency) plus its bytes (operands read, result written) over
HBM; the backward runs two GEMMs of the same size per forward GEMM (data and weight gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.features.mla import attention_parameters
from capture_megatron.steptime.constants import Constants
from capture_megatron.steptime.hardware import Hardware
from capture_megatron.steptime.settings import StepSettings


@dataclass(frozen=True)
class LayerTime:
    """Seconds one transformer layer takes on one GPU for one micro-batch."""

    forward: float
    """Forward: compute plus the communication left exposed."""
    backward: float
    """Backward: compute plus the communication left exposed."""
    recomputed_forward: float
    """The forward of the modules selective recompute re-runs in the backward (--recompute-modules;
    its default: the attention core); 0 without selective recompute."""


@dataclass(frozen=True)
class Setting:
    """Everything a piece of the step's time depends on besides the model and the plan."""

    hw: Hardware
    """The accelerator and its links."""
    run: StepSettings
    """Overlap and precision settings of the run."""
    k: Constants
    """The model's fitted constants."""


def gemm(s: Setting, m: float, n: float, k: float) -> float:
    """Seconds of one bf16 GEMM (m x k) @ (k x n) on one GPU."""
    flops = 2 * m * n * k / (s.hw.peak_flops * s.k.gemm_efficiency)
    return flops + 2 * (m * k + k * n + m * n) / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)


def tokens(shape: ModelShape, plan: ParallelPlan) -> float:
    """Tokens one GPU processes per micro-batch (its 1 / CP share of the sequence)."""
    return plan.micro_batch_size * shape.seq_length / plan.cp


def sequence_tokens(shape: ModelShape, plan: ParallelPlan) -> float:
    """Tokens of the hidden states one GPU holds per micro-batch: 1 / TP of `tokens` with
    sequence parallelism."""
    return tokens(shape, plan) / (plan.tp if plan.sequence_parallel else 1)


def ring(s: Setting, nbytes: float, ranks: int, bandwidth: float, passes: float = 1.0) -> float:
    """Seconds of a ring collective moving `nbytes` (the whole tensor) among `ranks`: passes 1 for
    an all-gather or reduce-scatter, 2 for an all-reduce."""
    if ranks <= 1:
        return 0.0
    return passes * (ranks - 1) / ranks * nbytes / (bandwidth * s.k.link_efficiency)


def dense_gemms(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> float:
    """Forward seconds of a layer's linear layers (QKV, projection, MLP or routed experts)."""
    t, n_tok, h = plan.tp, tokens(shape, plan), shape.hidden_size
    a, g, d = shape.num_attention_heads, shape.groups, shape.head_dim
    up = 2 if shape.gated else 1
    total = gemm(s, n_tok, (a + 2 * g) * d / t, h) + gemm(s, n_tok, h, a * d / t)
    if not moe:
        return total + gemm(s, n_tok, up * shape.ffn / t, h) + gemm(s, n_tok, h, shape.ffn / t)
    m = shape.moe
    local = max(m.num_experts // plan.ep, 1)  # experts on this rank, each with its share of tokens
    per = n_tok * m.moe_router_topk * plan.ep / m.num_experts * (plan.tp / plan.expert_tp)
    f, et = shape.moe_ffn, plan.expert_tp
    experts = local * (gemm(s, per, up * f / et, h) + gemm(s, per, h, f / et))
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        experts += gemm(s, n_tok, up * shared / t, h) + gemm(s, n_tok, h, shared / t)
    return total + experts + gemm(s, n_tok, m.num_experts, h)  # the router


def attention(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core. Fused (flash / cuDNN): the causal half of
    the s x s work, backward 2.5 x the forward's FLOPs, at attention_efficiency. Unfused: both
    batched GEMMs over the whole s x s plus the scores' softmax, mask and dropout through HBM."""
    heads = shape.num_attention_heads / plan.tp
    b, n_tok, d = plan.micro_batch_size, tokens(shape, plan), shape.head_dim
    full = 4 * n_tok * shape.seq_length * heads * d  # QK^T and PV, every query against every key
    if s.run.fused_attention:
        fwd = full / 2 / (s.hw.peak_flops * s.k.attention_efficiency)
        return fwd, 2.5 * fwd * (s.k.deterministic_backward if s.run.deterministic else 1.0)
    scores = b * heads * (n_tok / b) * shape.seq_length
    gemms = full / (s.hw.peak_flops * s.k.gemm_efficiency)
    traffic = scores * 2 / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)
    return gemms + 4 * traffic, 2 * gemms + 6 * traffic


def elementwise(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> float:
    """Forward seconds of a layer's memory-bound kernels: norms, RoPE, activation, dropout and
    residual adds (elementwise_passes reads or writes of each hidden-size activation, on 1 / TP of
    the tokens with sequence parallelism; three of each MLP activation; the backward twice)."""
    n_tok, t = tokens(shape, plan), plan.tp
    hidden = sequence_tokens(shape, plan) * shape.hidden_size
    width = shape.moe_ffn * shape.moe.moe_router_topk if moe else shape.ffn
    mlp = n_tok * width / t * (2 if shape.gated else 1)
    passes = s.k.elementwise_passes + (2 if shape.hidden_dropout else 0)  # dropout masks
    nbytes = dtype_bytes(shape.dtype) * (passes * hidden + 3 * mlp)
    return nbytes / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)


def unfused_wgrad(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> float:
    """Backward seconds of adding a layer's weight gradients into the fp32 main gradients when
    they are not accumulated in place (--no-gradient-accumulation-fusion): each 16-bit gradient
    written, read back, and the main gradient read and written."""
    if s.run.gradient_accumulation_fusion:
        return 0.0
    params = layer_params(shape, plan.tp, moe, plan.ep)
    return params * (2 + 2 + 4 + 4) / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)


def tp_comm(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one layer's tensor-parallel collectives, each moving
    the layer's activations. Forward: the two row-parallel outputs' all-reduces (with SP the two
    all-gathers before and reduce-scatters after), all exposed. Backward (Transformer Engine's
    linear layers): the column-parallel input gradients' all-reduces (with SP their reduce-scatters,
    and the inputs' all-gathers for the weight gradients) run while the weight-gradient GEMMs do;
    with SP the row-parallel layers' output-gradient all-gathers are exposed. Under
    --tp-comm-overlap the fraction tp_overlap_exposed of every collective is left."""
    if plan.tp == 1:
        return 0.0, 0.0
    n_tok, h, t = tokens(shape, plan), shape.hidden_size, plan.tp
    nbytes = n_tok * h * dtype_bytes(shape.dtype)
    one = ring(s, nbytes, t, s.hw.link_bytes_per_s(0, t, 1))  # one all-gather / reduce-scatter
    if s.run.tp_comm_overlap:
        return 4 * one * s.k.tp_overlap_exposed, 4 * one * s.k.tp_overlap_exposed
    up = 2 if shape.gated else 1
    a, g, d = shape.num_attention_heads, shape.groups, shape.head_dim
    column = gemm(s, n_tok, (a + 2 * g) * d / t, h) + gemm(s, n_tok, up * shape.ffn / t, h)
    if plan.sequence_parallel:
        return 4 * one, 2 * one + max(0.0, 4 * one - 2 * column)
    return 4 * one, max(0.0, 4 * one - column)


def cp_comm(
    s: Setting, shape: ModelShape, plan: ParallelPlan, attn: tuple[float, float]
) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of context parallelism's K/V ring (TE p2p): each of the
    cp - 1 steps passes this rank's K and V (backward: and their gradients) to the next rank while
    the attention of the current chunk runs; what the attention cannot hide is exposed. The
    a2a / allgather types move the same volume (allgather: every chunk at once)."""
    if plan.cp == 1:
        return 0.0, 0.0
    kv = 2 * tokens(shape, plan) * shape.groups * shape.head_dim / plan.tp
    step = (
        kv
        * dtype_bytes(shape.dtype)
        / (s.hw.link_bytes_per_s(0, plan.cp, plan.tp) * s.k.link_efficiency)
    )
    steps = plan.cp - 1
    fwd = max(0.0, steps * step - attn[0] * steps / plan.cp)
    bwd = max(0.0, 2 * steps * step - attn[1] * steps / plan.cp)
    return fwd, bwd


def ep_comm(s: Setting, shape: ModelShape, plan: ParallelPlan) -> float:
    """Seconds of one MoE layer's expert-parallel all-to-alls per direction (dispatch and combine
    of top-k copies of the tokens, the (ep - 1) / ep that leave the rank); 0 without EP."""
    if plan.ep == 1:
        return 0.0
    nbytes = tokens(shape, plan) * shape.hidden_size * dtype_bytes(shape.dtype)
    moved = 2 * shape.moe.moe_router_topk * nbytes / plan.tp * (plan.ep - 1) / plan.ep
    return moved / (s.hw.link_bytes_per_s(0, plan.ep, plan.expert_tp) * s.k.link_efficiency)


def layer_time(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool = False) -> LayerTime:
    """One transformer layer's forward and backward on one GPU for one micro-batch, with the
    fine-grained activation offloading transfers the layer's compute does not hide."""
    gemms, elem = dense_gemms(s, shape, plan, moe), elementwise(s, shape, plan, moe)
    attn = attention(s, shape, plan)
    cp = cp_comm(s, shape, plan, attn)
    tp = tp_comm(s, shape, plan)
    ep = ep_comm(s, shape, plan) if moe else 0.0
    fwd = gemms + attn[0] + elem + tp[0] + ep + cp[0]
    bwd = 2 * gemms + attn[1] + 2 * elem + tp[1] + ep + cp[1] + unfused_wgrad(s, shape, plan, moe)
    moved = offloaded_bytes(shape, plan, moe) / s.hw.host_bytes_per_s
    fwd, bwd = fwd + max(moved - fwd, 0.0), bwd + max(moved - bwd, 0.0)
    return LayerTime(fwd, bwd, recomputed(s, shape, plan, moe, attn[0], tp[0] + ep))


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


def recomputed(
    s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool, attn: float, comm: float
) -> float:
    """Forward seconds selective recompute runs again in one layer's backward: each module of
    --recompute-modules that megatron-core 0.16.1 checkpoints in this kind of layer, priced as
    the same pieces of the forward. core_attn: the attention core (`attn`); mlp (dense layers)
    and moe (MoE layers): the MLP's GEMMs, its activation and half the layer's exposed TP (and
    EP) communication (`comm`: the MLP's share); moe_act: the experts' activation; shared_experts:
    the shared experts' GEMMs; layernorm: the two norms (a read and a write of the hidden
    states each); mla_up_proj: MLA's query and key/value up-projections."""
    chosen = plan.recompute.selected
    if not chosen:
        return 0.0
    n_tok, t, h, up = tokens(shape, plan), plan.tp, shape.hidden_size, 2 if shape.gated else 1
    hbm = s.hw.hbm_bytes_per_s * s.k.memory_efficiency
    width = shape.moe_ffn * shape.moe.moe_router_topk if moe else shape.ffn
    act = dtype_bytes(shape.dtype) * 3 * n_tok * width / t * up / hbm
    total = attn if "core_attn" in chosen else 0.0
    mlp_part = "mlp" in chosen and not moe or "moe" in chosen and moe
    if mlp_part:
        gemms = _mlp_gemms(s, shape, plan) if moe else dense_gemms_mlp(s, shape, plan)
        total += gemms + act + comm / 2
    elif moe and "moe_act" in chosen and shape.moe.moe_grouped_gemm:
        total += act
    shared = shape.moe.moe_shared_expert_intermediate_size
    if moe and shared and "shared_experts" in chosen and not mlp_part:
        total += gemm(s, n_tok, up * shared / t, h) + gemm(s, n_tok, h, shared / t)
    if "layernorm" in chosen:
        hidden = sequence_tokens(shape, plan) * h
        total += 2 * 2 * dtype_bytes(shape.dtype) * hidden / hbm
    mla = shape.mla
    if "mla_up_proj" in chosen and mla.enabled:
        a = shape.num_attention_heads / t
        q_in = mla.q_lora_rank or 0
        q_dims = a * (mla.qk_head_dim + mla.qk_pos_emb_head_dim)
        total += gemm(s, n_tok, q_dims, q_in) if q_in else 0.0
        total += gemm(s, n_tok, a * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    return total


def _mlp_gemms(s: Setting, shape: ModelShape, plan: ParallelPlan) -> float:
    """Forward seconds of an MoE layer's routed and shared experts and router GEMMs."""
    attn_only = dense_gemms(s, shape, plan, False) - dense_gemms_mlp(s, shape, plan)
    return dense_gemms(s, shape, plan, True) - attn_only


def dense_gemms_mlp(s: Setting, shape: ModelShape, plan: ParallelPlan) -> float:
    """Forward seconds of a dense layer's two MLP GEMMs."""
    n_tok, t, h, up = tokens(shape, plan), plan.tp, shape.hidden_size, 2 if shape.gated else 1
    return gemm(s, n_tok, up * shape.ffn / t, h) + gemm(s, n_tok, h, shape.ffn / t)


def head_time(s: Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(forward, backward) seconds of the final norm, output layer and cross entropy (fp32
    logits written and read back in each direction) on the last pipeline stage."""
    n_tok, vocab = tokens(shape, plan), shape.padded_vocab(plan.tp) / plan.tp
    out = gemm(s, n_tok, vocab, shape.hidden_size)
    loss = 4 * 4 * n_tok * vocab / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)
    return out + loss, 2 * out + loss


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
