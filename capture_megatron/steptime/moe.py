"""An MoE layer's expert block on one GPU for one micro-batch, with its own structure (megatron-core
0.16.1 transformer/moe): the router, the permute and unpermute passes, dispatch and combine over
the expert-parallel group, the routed experts' GEMMs on the busiest EP rank, the shared experts,
and what overlaps what. Pure Python.

- Tokens: each rank routes its sequence-parallel share T of the micro-batch's tokens (megatron-core
  dispatches the SP-local tokens; with expert TP > 1 the received tokens are then gathered over
  the expert-TP group). A rank's experts receive T x top-k x ETP x f tokens, f the routing
  factor of the busiest EP rank: the capacity factor with --moe-pad-expert-input-to-capacity
  (every expert padded to its capacity), else the same forecast the memory model uses
  (capture_megatron.forecast.routing: the expected max over EP ranks), capped by a capacity
  factor. The busiest rank sets the time: its GEMMs and what it receives.
- Router: the gating GEMM (in fp32 with --moe-router-dtype fp32 at the GPU's FP32 rate), the
  scores' passes (softmax / sigmoid, top-k, the load-balancing loss).
- Permute / unpermute: memory-bound passes over the routed tokens (T x top-k x hidden) before the
  dispatch and after the combine (one fused kernel each with --moe-permute-fusion, twice the
  traffic without), and the alltoall dispatcher's sort of the received chunks by local expert.
- Dispatch and combine (one each way per forward, again in the backward): alltoall sends T x
  top-k tokens, the share for ranks outside the GPU's NVLink domain over its own NIC, the rest
  over NVLink, at all_to_all_efficiency; allgather gathers every rank's tokens over the TP x EP
  group (a ring) and reduce-scatters them back; flex (DeepEP, HybridEP) sends each token once
  per remote NVLink domain its experts sit in and forwards it inside the domain over NVLink, at
  flex_efficiency (DeepEP's published bandwidths); DeepEP's domain is at most 8 GPUs, HybridEP's
  the whole NVLink domain. Each call adds dispatch_latency.
- Experts: a grouped GEMM per projection over the rank's local experts, each expert's rows
  rounded up to the grouped GEMM's tile (grouped_gemm_tile), so efficiency falls at few tokens
  per expert (its weights read from HBM for few rows count too, capture_megatron.steptime.kernels
  .gemm); without --moe-grouped-gemm one GEMM per expert.
- Shared experts: a TP-split MLP on every token; with --moe-shared-expert-overlap its first
  projection runs while the dispatch does and its second while the combine does.
- EP overlap (--overlap-moe-expert-parallel-comm, megatron-core's merged 1F1B schedule,
  models/common/model_chunk_schedule_plan.py TransformerLayerSchedulePlan.run): one
  micro-batch's forward runs beside another's backward layer by layer on a compute and a
  communication stream: the combine's backward beside the attention's forward, the dispatch
  beside the MLP's backward, the dispatch's backward beside the MLP's forward, the combine beside
  the attention's backward; --delay-wgrad-compute lets the dispatch's backward start after the
  MLP's data gradient (its weight gradient runs beside it) and the next layer's combine backward
  after the attention's data gradient. A timeline of the two streams gives what stays exposed
  (merged_layer); the warm-up and cool-down micro-batches, which run alone, are taken as
  overlapped too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.forecast.routing import routing_factor
from capture_megatron.steptime.attention import TpBlock
from capture_megatron.steptime.kernels import (
    Setting,
    gemm,
    hbm,
    ring,
    sequence_tokens,
    tokens,
)

DEEPEP_NVL_PEERS = 8
"""GPUs DeepEP's normal kernels reach over NVLink (deep_ep's NUM_MAX_NVL_PEERS); beyond them it
goes over RDMA, where HybridEP uses the whole NVLink domain (e.g. 72 GPUs of a GB200 NVL72)."""
ROUTER_PASSES = 12
"""Reads and writes of the router's fp32 scores per forward (scores, top-k and its group limit,
the expert bias, normalisation, the load-balancing loss's statistics)."""


@dataclass(frozen=True)
class MoeBlock:
    """Forward seconds of one MoE layer's expert block on the busiest EP rank, by piece (the
    backward: twice each GEMM, the passes again, the communication again)."""

    router: float
    """Gating GEMM and the scores' passes."""
    permute: float
    """Permute, unpermute and chunk-sort passes over the routed tokens."""
    experts: float
    """The routed experts' GEMMs and activation."""
    activation: float
    """The routed experts' activation alone (part of `experts`; what moe_act recomputes)."""
    shared_fc1: float
    """The shared experts' first projection and activation (0 without shared experts)."""
    shared_fc2: float
    """The shared experts' second projection."""
    shared_tp: TpBlock | None
    """The shared experts' tensor-parallel block (None without shared experts or at TP 1)."""
    dispatch: float
    """One dispatch's communication (tokens to their experts' ranks), latency included."""
    combine: float
    """One combine's communication (expert outputs back)."""
    expert_tp: float
    """The expert-TP all-gather after the dispatch and reduce-scatter before the combine."""
    factor: float
    """Tokens the busiest EP rank receives over its balanced share."""
    tokens_per_expert: float
    """Tokens each of the busiest rank's local experts computes per micro-batch."""

    @property
    def shared(self) -> float:
        """The shared experts' forward."""
        return self.shared_fc1 + self.shared_fc2

    @property
    def comm(self) -> float:
        """Dispatch and combine of one forward."""
        return self.dispatch + self.combine


def imbalance(shape: ModelShape, plan: ParallelPlan) -> float:
    """Tokens the busiest EP rank's experts compute over their balanced share: the capacity factor
    when inputs are padded to capacity, else the routing forecast the memory model uses (1 at EP
    1 or with forced balancing), no more than a capacity factor."""
    moe = shape.moe
    cf = moe.moe_expert_capacity_factor
    if cf and moe.moe_pad_expert_input_to_capacity:
        return cf
    f = routing_factor(shape, plan).forecast
    return min(f, cf) if cf else f


def ep_local(s: Setting, plan: ParallelPlan, domain: int = 0) -> int:
    """EP-group members sharing a GPU's NVLink domain (or the `domain` GPUs a dispatcher treats as
    one; EP ranks sit expert-TP apart, Megatron's expert rank order tp-ep-dp-pp)."""
    domain = domain or s.hw.nvlink_domain
    span = plan.ep * plan.expert_tp
    if span <= domain:
        return plan.ep
    return max(1, min(plan.ep, domain // plan.expert_tp))


def _remote_domains(shape: ModelShape, domains: int) -> float:
    """Expected NVLink domains other than its own a token's top-k experts sit in, experts spread
    evenly over `domains` (with group-limited routing and at least a group per domain, at most
    the domains the chosen groups sit in)."""
    moe = shape.moe
    e, k = moe.num_experts, moe.moe_router_topk
    per = e // domains
    untouched = math.comb(e - per, k) / math.comb(e, k) if e - per >= k else 0.0
    distinct = domains * (1 - untouched)
    groups, limit = moe.moe_router_num_groups, moe.moe_router_group_topk
    if groups >= domains and limit:
        distinct = min(distinct, limit * domains / groups)
    return distinct * (domains - 1) / domains


def communication(
    s: Setting, shape: ModelShape, plan: ParallelPlan, factor: float
) -> tuple[float, float]:
    """(dispatch, combine) seconds of one forward's token exchange over the EP group (the
    dispatcher's structure, module docstring)."""
    moe, b, h = shape.moe, dtype_bytes(shape.dtype), shape.hidden_size
    local_tokens = sequence_tokens(shape, plan)
    kind = moe.moe_token_dispatcher_type
    latency = s.k.dispatch_latency
    if kind == "allgather":
        group = plan.ep * plan.expert_tp
        if group == 1:
            return 0.0, 0.0
        bw = s.hw.link_bytes_per_s(0, group, 1)
        one = ring(s, group * local_tokens * h * b, group, bw) + latency
        return one, one
    if plan.ep == 1:
        return 0.0, 0.0
    routed = local_tokens * moe.moe_router_topk * h * b * factor
    nvlink, network = s.hw.nvlink_bytes_per_s, s.hw.network_bytes_per_s
    if kind == "flex":
        # DeepEP's NVLink kernels reach at most 8 peers (NUM_MAX_NVL_PEERS); HybridEP the domain
        deepep = moe.moe_flex_dispatcher_backend == "deepep"
        local = ep_local(s, plan, min(s.hw.nvlink_domain, DEEPEP_NVL_PEERS) if deepep else 0)
        domains = -(-plan.ep // local)
        remote = local_tokens * h * b * _remote_domains(shape, domains)
        eff = s.k.flex_efficiency
        one = max(routed * (local - 1) / local / (nvlink * eff), remote / (network * eff))
        return one + latency, one + latency
    local = ep_local(s, plan)
    eff = s.k.all_to_all_efficiency
    inside = routed * (local - 1) / plan.ep / (nvlink * eff)
    outside = routed * (plan.ep - local) / plan.ep / (network * eff)
    one = max(inside, outside) + latency
    return one, one


def _permute(s: Setting, shape: ModelShape, plan: ParallelPlan, received: float) -> float:
    """Forward seconds of the permute and unpermute passes (and the alltoall dispatcher's sort of
    the received chunks by local expert) for `received` tokens on the rank."""
    moe, b, h = shape.moe, dtype_bytes(shape.dtype), shape.hidden_size
    local_tokens = sequence_tokens(shape, plan)
    if moe.moe_token_dispatcher_type == "allgather":
        gathered = plan.ep * plan.expert_tp * local_tokens
        nbytes = (2 * received + received + gathered) * h * b  # gather out, scatter-add back
    else:
        routed = received / plan.expert_tp  # this rank's own tokens' copies (before ETP gather)
        nbytes = 2 * (local_tokens + routed) * h * b  # permute and unpermute
        local_experts = moe.num_experts // plan.ep
        if moe.moe_token_dispatcher_type == "alltoall" and plan.ep > 1 and local_experts > 1:
            nbytes += 2 * 2 * received * h * b  # sort by local expert, and back
    return hbm(s, nbytes * (1 if s.run.moe_permute_fusion else 2))


def _router(s: Setting, shape: ModelShape, plan: ParallelPlan) -> float:
    """Forward seconds of the router: the gating GEMM (fp32 at the FP32 rate when the router
    runs in fp32 / fp64) and its scores' passes."""
    moe, local_tokens = shape.moe, sequence_tokens(shape, plan)
    flops = 2 * local_tokens * shape.hidden_size * moe.num_experts
    if moe.moe_router_dtype in ("fp32", "fp64"):
        gating = flops / s.hw.fp32_flops + hbm(s, 4 * local_tokens * shape.hidden_size)
    else:
        gating = gemm(s, local_tokens, moe.num_experts, shape.hidden_size)
    return gating + hbm(s, ROUTER_PASSES * 4 * local_tokens * moe.num_experts)


def _experts(
    s: Setting, shape: ModelShape, plan: ParallelPlan, received: float
) -> tuple[float, float, float]:
    """(GEMMs and activation, activation alone, tokens per expert) of the rank's local experts
    computing `received` tokens: grouped GEMMs with each expert's rows rounded up to the tile."""
    moe, h, etp = shape.moe, shape.hidden_size, plan.expert_tp
    up, f = (2 if shape.gated else 1), shape.moe_ffn / etp
    local_experts = max(moe.num_experts // plan.ep, 1)
    per = received / local_experts
    rows = per
    if moe.moe_grouped_gemm and per > 0:
        tile = s.k.grouped_gemm_tile
        rows = math.ceil(per / tile) * tile
    gemms = local_experts * (gemm(s, rows, up * f, h) + gemm(s, rows, h, f))
    act = hbm(s, 3 * received * up * f * dtype_bytes(shape.dtype))
    return gemms + act, act, per


def _shared(
    s: Setting, shape: ModelShape, plan: ParallelPlan
) -> tuple[float, float, TpBlock | None]:
    """(first projection and activation, second projection, TP block) of the shared experts: an
    MLP split over TP on every token of the micro-batch."""
    width = shape.moe.moe_shared_expert_intermediate_size
    if not width:
        return 0.0, 0.0, None
    n_tok, t, h, b = tokens(shape, plan), plan.tp, shape.hidden_size, dtype_bytes(shape.dtype)
    up = 2 if shape.gated else 1
    fc1 = gemm(s, n_tok, up * width / t, h)
    act = hbm(s, 3 * n_tok * up * width / t * b)
    block = TpBlock(n_tok * h * b, n_tok * h * b, fc1) if t > 1 else None
    return fc1 + act, gemm(s, n_tok, h, width / t), block


def block(s: Setting, shape: ModelShape, plan: ParallelPlan) -> MoeBlock:
    """The expert block of one MoE layer (module docstring)."""
    factor = imbalance(shape, plan)
    received = sequence_tokens(shape, plan) * shape.moe.moe_router_topk * plan.expert_tp * factor
    experts, act, per = _experts(s, shape, plan, received)
    dispatch, combine = communication(s, shape, plan, factor)
    fc1, fc2, shared_tp = _shared(s, shape, plan)
    expert_tp = 0.0
    if plan.expert_tp > 1 and shape.moe.moe_token_dispatcher_type != "allgather":
        nbytes = received * shape.hidden_size * dtype_bytes(shape.dtype)
        bw = s.hw.link_bytes_per_s(0, plan.expert_tp, 1)
        expert_tp = 2 * ring(s, nbytes, plan.expert_tp, bw)
    return MoeBlock(
        router=_router(s, shape, plan),
        permute=_permute(s, shape, plan, received),
        experts=experts,
        activation=act,
        shared_fc1=fc1,
        shared_fc2=fc2,
        shared_tp=shared_tp,
        dispatch=dispatch,
        combine=combine,
        expert_tp=expert_tp,
        factor=factor,
        tokens_per_expert=per,
    )


def ep_overlap(shape: ModelShape, plan: ParallelPlan) -> bool:
    """Whether megatron-core's merged 1F1B schedule overlaps this plan's EP communication
    (--overlap-moe-expert-parallel-comm with the alltoall or flex dispatcher, EP > 1)."""
    kind = shape.moe.moe_token_dispatcher_type
    return bool(plan.ddp.overlap_moe_expert_parallel_comm) and kind != "allgather" and plan.ep > 1


def merged_layer(
    attention: tuple[float, float], mlp: tuple[float, float], moe: MoeBlock, delay: bool
) -> float:
    """Seconds of one layer of megatron-core's merged 1F1B step (one micro-batch's forward beside
    another's backward) in the steady state, from a two-stream timeline of three such layers in
    a row: the compute stream runs attention forward, MLP backward (its data gradient, then its
    weight gradient), MLP forward, attention backward (its weight gradient last under
    --delay-wgrad-compute); the communication stream the combine's backward, the dispatch, the
    dispatch's backward, the combine; each waits for what it needs (the dispatch for the
    attention forward, the dispatch's backward for the MLP's data gradient -- its whole backward
    without delayed weight gradients --, the MLP forward for the dispatch, the combine for the
    MLP forward, the attention backward for the dispatch's backward; the next layer's combine
    backward for this attention backward's data gradient, its attention forward for this
    combine)."""
    d, c = moe.dispatch, moe.combine
    a_dw = attention[1] / 4 if delay else 0.0  # the attention's linear weight gradients
    comp_free = comm_free = 0.0
    attn_grad = combine_out = 0.0
    ends = []
    for _ in range(3):
        cb = max(comm_free, attn_grad) + c  # combine backward
        af = max(comp_free, combine_out) + attention[0]
        df = max(cb, af) + d
        dgrad = max(af, cb) + (mlp[1] / 2 if delay else mlp[1])
        db = max(df, dgrad) + d
        mf = max(dgrad + (mlp[1] / 2 if delay else 0.0), df) + mlp[0]
        cf = max(db, mf) + c
        ab = max(mf, db) + attention[1] - a_dw
        comp_free, comm_free = ab + a_dw, cf
        attn_grad, combine_out = ab, cf
        ends.append(max(comp_free, comm_free))
    return (ends[2] - ends[0]) / 2


def exposed(
    s: Setting,
    shape: ModelShape,
    plan: ParallelPlan,
    moe: MoeBlock,
    attention: tuple[float, float],
) -> tuple[float, float, bool]:
    """(forward, backward) seconds of the block's dispatch and combine left exposed, and whether
    the shared experts' TP collectives hide behind them. `attention` is the layer's attention
    block (forward, backward: with the router and permutes) the merged schedule overlaps the
    combines with (merged_layer); its exposure is split evenly between forward and backward."""
    d, c = moe.dispatch, moe.combine
    if ep_overlap(shape, plan):
        delay = s.run.delay_wgrad_compute or plan.ddp.delay_wgrad_compute
        mlp = (moe.experts + moe.shared, 2 * (moe.experts + moe.shared))
        compute = sum(attention) + sum(mlp)
        left = max(0.0, merged_layer(attention, mlp, moe, delay) - compute)
        return left / 2, left / 2, False
    overlap = s.run.moe_shared_expert_overlap and moe.shared > 0 and plan.ep > 1
    if not overlap:
        return d + c, d + c, False
    fwd = max(0.0, d - moe.shared_fc1) + max(0.0, c - moe.shared_fc2)
    bwd = max(0.0, c - 2 * moe.shared_fc2) + max(0.0, d - 2 * moe.shared_fc1)
    return fwd, bwd, True
