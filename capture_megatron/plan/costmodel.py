"""Estimated step time of a plan, to rank plans that fit (the `throughput` objective). Pure Python.

Per micro-batch and pipeline stage: transformer-layer FLOPs (forward 2 x matmul work + attention;
backward twice that; full recompute adds a forward, selective recompute re-runs the attention core)
at a stated fraction of peak FLOP/s, plus tensor-parallel all-reduces (4 per layer per micro-batch,
ring over NVLink bandwidth; with SP reduce-scatter + all-gather of the same volume). MoE layers
count the top-k routed experts' and the shared experts' FLOPs per token and the expert-parallel
all-to-alls (every layer taken as an MoE layer). With context parallelism each rank computes and
communicates for its s / CP tokens, plus TE's K/V ring (context_comm). The pipeline takes
(m + (p - 1) / v) slowest-stage micro-batch times (the bubble (p - 1)/(m v)), plus pipeline sends
and the data-parallel gradient all-reduce (over DP x CP; ring over the network bandwidth).
Calibrate `efficiency` from measured step times (capture-megatron verify) for absolute numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes


@dataclass(frozen=True)
class Hardware:
    """What the cost model assumes about the machines."""

    peak_flops: float = 989e12
    """Dense bf16 FLOP/s of one accelerator (H100 SXM: 989 TFLOP/s)."""
    efficiency: float = 0.4
    """Fraction of peak the matmuls reach (model FLOPs utilisation)."""
    intra_node_bytes_per_s: float = 450e9
    """NVLink bandwidth per GPU (TP collectives)."""
    inter_node_bytes_per_s: float = 50e9
    """Network bandwidth per GPU (DP and PP traffic)."""


def layer_forward_flops(shape: ModelShape, b: int) -> float:
    """Forward FLOPs of one transformer layer for one micro-batch (whole layer, before TP split)."""
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
    if shape.moe.enabled:  # top-k routed experts and the shared experts per token, the router
        moe = shape.moe
        f = moe.moe_router_topk * shape.moe_ffn + moe.moe_shared_expert_intermediate_size
        proj += 2 * b * s * h * moe.num_experts
    mlp = 2 * b * s * h * f * (3 if shape.gated else 2)
    core = 4 * b * a * s * s * d
    return qkv + proj + mlp + core


def expert_comm(shape: ModelShape, plan: ParallelPlan, act_bytes: float, hw: Hardware) -> float:
    """Seconds of one MoE layer's expert-parallel all-to-alls per micro-batch (dispatch and
    combine, forward and backward: 4 x top-k copies of the tokens, the (ep - 1) / ep that leave the
    rank; over NVLink while EP x TP stays in a node, else the network); 0 without EP."""
    if not shape.moe.enabled or plan.ep == 1:
        return 0.0
    moved = 4 * shape.moe.moe_router_topk * act_bytes / plan.tp * (plan.ep - 1) / plan.ep
    rate = hw.intra_node_bytes_per_s if plan.ep * plan.tp <= 8 else hw.inter_node_bytes_per_s
    return moved / rate


def context_comm(shape: ModelShape, plan: ParallelPlan, hw: Hardware) -> float:
    """Seconds of one layer's context-parallel ring per micro-batch (TE's p2p: K and V pass
    cp - 1 times forward, K, V, dK and dV backward, each rank's s / cp tokens of the TP-local
    query groups; taken as not overlapped; over NVLink while TP x CP stays in a node); 0 without
    CP."""
    if plan.cp == 1:
        return 0.0
    kv = 2 * plan.micro_batch_size * shape.seq_length / plan.cp * shape.groups * shape.head_dim
    moved = 3 * (plan.cp - 1) * kv * dtype_bytes(shape.dtype) / plan.tp
    rate = hw.intra_node_bytes_per_s if plan.cp * plan.tp <= 8 else hw.inter_node_bytes_per_s
    return moved / rate


def step_seconds(
    shape: ModelShape, plan: ParallelPlan, hw: Hardware = Hardware(), bound: bool = False
) -> float:
    """Estimated seconds per optimizer step. With `bound`, a lower bound over every layout and
    recompute setting of the plan's sizes: no recompute, and the slowest stage replaced by the mean
    (the search uses it to stop once no unexplored plan can be faster)."""
    b, t, p, v, m = plan.micro_batch_size, plan.tp, plan.pp, plan.vpp, plan.num_microbatches
    rate, tokens = hw.peak_flops * hw.efficiency, shape.seq_length / plan.cp  # per CP rank
    fwd = layer_forward_flops(shape, b) / t / plan.cp
    core = 4 * b * shape.num_attention_heads * shape.seq_length**2 * shape.head_dim / t / plan.cp
    act_bytes = b * tokens * shape.hidden_size * dtype_bytes(shape.dtype)
    tp_comm = 0.0 if t == 1 else 4 * 2 * (t - 1) / t * act_bytes / hw.intra_node_bytes_per_s
    tp_comm += expert_comm(shape, plan, act_bytes, hw) + context_comm(shape, plan, hw)
    head = 3 * 2 * b * tokens * shape.hidden_size * shape.padded_vocab(t) / t / rate
    if bound:
        per_chunk = (shape.num_layers * (3 * fwd / rate + tp_comm) + head) / (p * v)
    else:
        stage_times = []
        for r in range(p):
            k = plan.layers_of(r)
            n = min(plan.recompute.layers_on(r), k) if plan.recompute.granularity == "full" else 0
            n = k if n and plan.recompute.method == "uniform" else n  # uniform recomputes all
            extra = n * fwd + (k * core if plan.recompute.granularity == "selective" else 0.0)
            compute = (3 * k * fwd + extra) / rate + k * tp_comm + (head if r == p - 1 else 0.0)
            stage_times.append(compute / v)
        per_chunk = max(stage_times)
    pipeline = (m * v + p - 1) * per_chunk + (
        2 * m * act_bytes / t / hw.inter_node_bytes_per_s if p > 1 else 0.0
    )
    params = 12 * shape.hidden_size**2 * shape.num_layers / (t * p)
    ranks = plan.dp * plan.cp  # megatron reduces gradients over DP x CP
    dp_comm = (
        0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * params * 4 / hw.inter_node_bytes_per_s
    )
    return pipeline + dp_comm
