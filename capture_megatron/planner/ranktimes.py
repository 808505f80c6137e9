"""Pipeline ranks' per-micro-batch times for the time-aware partition (planner.timed):
what a rank holding k identical layers takes (costmodel.chunk_seconds), the chunk splits searched,
and the least bottleneck and step any split can have when memory is no bound (the search's refined
lower bound). Pure Python."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.forecast.static import layout_of
from capture_megatron.planner.partition import TIE
from capture_megatron.planner.stepbound import BoundParts, bound_parts
from capture_megatron.steptime import parts as cp
from capture_megatron.steptime.model import ROUNDING, CostModel, chunk_seconds, overhead_per_pass
from capture_megatron.steptime.offload import device_share

EXACT_CHUNKS = 2
"""Up to this many chunks per rank every chunk split is searched; beyond, the near-even ones."""


def near_even(k: int, vpp: int) -> list[tuple[int, ...]]:
    """The splits of k layers over vpp chunks differing by at most one layer: the extra layers on
    the first chunks, or on the last."""
    q, extra = divmod(k, vpp)
    first = tuple(q + (v < extra) for v in range(vpp))
    return list(dict.fromkeys((first, first[::-1])))


def chunk_splits(k: int, vpp: int) -> list[tuple[int, ...]]:
    """The chunk splits of k layers searched, narrowest first."""
    if vpp == 1:
        return [(k,)]
    if vpp > EXACT_CHUNKS:
        return near_even(k, vpp)
    return sorted(((a, k - a) for a in range(k + 1)), key=lambda c: (max(c), c))


class RankTimes:
    """Per-micro-batch seconds of a pipeline rank holding some layers (costmodel.chunk_seconds),
    for a plan's sizes and recompute granularity; no memory."""

    def __init__(self, shape: ModelShape, plan: ParallelPlan, hw: CostModel) -> None:
        self.shape, self.plan = shape, plan
        s = hw.setting
        self.layer = cp.layer_time(s, shape, plan)
        self.head = cp.head_time(s, shape, plan)
        self.overhead = overhead_per_pass(hw)
        selective = plan.recompute.granularity == "selective"
        self.per_layer = (
            self.layer.forward
            + self.layer.backward
            + (self.layer.recomputed_forward if selective else 0.0)
        )
        """A layer's forward and backward (selective recompute's modules again)."""
        self.chunk_memo: dict[tuple[int, int, bool], tuple[float, float]] = {}
        """(forward, backward) seconds of a chunk by (layers, recomputed layers, holds the head)."""
        self.times: dict[tuple[tuple[int, ...], int, bool], tuple[float, float]] = {}
        """seconds by (chunks, recomputed layers, the last rank)."""

    def seconds(self, rank: int, chunks: tuple[int, ...], n: int) -> tuple[float, float]:
        """(the rank's time, its slowest chunk's) holding `chunks`, recomputing n per chunk."""
        plan, last = self.plan, self.plan.pp * self.plan.vpp - 1
        known = self.times.get((chunks, n, rank == plan.pp - 1))  # the last rank: the output
        if known is not None:
            return known
        selective = plan.recompute.granularity == "selective"
        uniform = plan.recompute.method == "uniform"
        fwds, bwds = [], []
        for v, k in enumerate(chunks):
            redo = (k if n else 0) if uniform else min(n, k)
            holds_head = v * plan.pp + rank == last
            key = (k, redo, holds_head)
            if key not in self.chunk_memo:  # identical layers: a few distinct chunks
                head = self.head if holds_head else None
                layers = [self.layer] * k
                self.chunk_memo[key] = chunk_seconds(layers, redo, selective, head, self.overhead)
            f, b = self.chunk_memo[key]
            fwds.append(f)
            bwds.append(b)
        found = self.times[chunks, n, rank == plan.pp - 1] = (
            sum(fwds) + sum(bwds), max(f + b for f, b in zip(fwds, bwds))
        )  # fmt: skip
        return found

    def fixed(self, rank: int) -> float:
        """The rank's time beside its layers: the chunks' overhead, the output layer and loss."""
        head = sum(self.head) if rank == self.plan.pp - 1 else 0.0
        return 2 * self.plan.vpp * self.overhead + head

    def unrecomputed(self, rank: int, k: int) -> float:
        """The rank's least time for k layers: no full recompute."""
        return k * self.per_layer + self.fixed(rank)

    def held(self, rank: int, limit: float) -> int:
        """The most layers the rank holds within `limit` seconds if memory were no bound."""
        k = max(0, min(self.shape.num_layers, int((limit - self.fixed(rank)) / self.per_layer)))
        while k > 0 and self.unrecomputed(rank, k) > limit:
            k -= 1
        while k < self.shape.num_layers and self.unrecomputed(rank, k + 1) <= limit:
            k += 1
        return k

    def least_bottleneck(self) -> tuple[float, float]:
        """(below, at): the least slowest-rank time of any split if memory were no bound lies
        in (below, at], within TIE. It is the least limit within which the ranks hold all n
        layers (held): the n-th least of the ranks' times for their first, second, ... layer
        (a rank's k-th layer fits within the limit when its time for k layers does)."""
        pp, n = self.plan.pp, self.shape.num_layers
        fixed, per = [self.fixed(r) for r in range(pp)], self.per_layer  # as in unrecomputed
        times = sorted(k * per + f for f in fixed for k in range(1, n + 1))
        at = times[n - 1]
        return at * (1 - TIE), at


def least_step(shape: ModelShape, plan: ParallelPlan, hw: CostModel) -> float:
    """A lower bound on the step of any split and recompute of the plan's sizes (layers of one
    kind): the least bottleneck without memory in the module docstring's bound. Tighter than
    stepbound.step_bound (whole layers; the output layer on the last rank)."""
    least = RankTimes(shape, plan, hw).least_bottleneck()[0]
    return lower_bound(bound_parts(shape, plan, hw), plan.num_microbatches, plan.vpp, least)


def lower_bound(parts: BoundParts, m: int, vpp: int, bottleneck: float) -> float:
    """The least step of any split whose slowest rank takes `bottleneck` or more (module
    docstring of capture_megatron.planner.timed; BoundParts.least)."""
    return parts.least(m, vpp, bottleneck) * ROUNDING


def beyond(parts: BoundParts, m: int, vpp: int, beat: float, low: float) -> float:
    """The least slowest-rank time (within a millionth) from which lower_bound reaches `beat`:
    no split whose slowest rank takes longer beats that step (inf: no step to beat; `low`: a
    time below it, the search's start)."""
    if beat == math.inf:
        return math.inf
    if lower_bound(parts, m, vpp, low) >= beat:
        return low
    hi = 2 * low or 1.0  # (a start of 0 would never double)
    while lower_bound(parts, m, vpp, hi) < beat:
        low, hi = hi, 2 * hi
    while hi - low > 1e-6 * hi:
        mid = (low + hi) / 2
        low, hi = (low, mid) if lower_bound(parts, m, vpp, mid) >= beat else (mid, hi)
    return hi


def _per_param(shape: ModelShape, plan: ParallelPlan, low_params: bool, shards: int) -> float:
    """Bytes a parameter takes at least: itself (1 byte as a low-precision parameter), its gradient
    buffer's element and its rank's share over `shards` ranks of the optimizer state kept on
    the device (master weights and moments: the Layout the forecast uses, predict.static);
    under Megatron-FSDP each of them over `shards` where its strategy shards it."""
    layout = layout_of(shape.dtype, plan.ddp, 1, True, param_bytes=1 if low_params else 0)
    state = layout.state * device_share(plan)
    if plan.ddp.fsdp.enabled:  # Megatron-FSDP shards what its strategy says over all of them
        weights, optimizer, grads = (shards if s else 1 for s in plan.ddp.fsdp.sharded())
        return layout.param / weights + layout.grad / grads + state / optimizer
    shards = plan.ddp.shard_ranks(shards) if plan.distributed_optimizer else 1
    return layout.param + layout.grad + state / shards


@functools.lru_cache(maxsize=8)
def _bare(shape: ModelShape) -> ModelShape:
    """The model without biases (a floor's parameters), built once per model."""
    return replace(shape, add_bias_linear=False)


def _layer_bytes(shape: ModelShape, plan: ParallelPlan, low_params: bool) -> tuple[float, float]:
    """(a dense layer's, an MoE layer's) parameters, gradients and optimizer share on one rank
    (_per_param; routed experts' moments shard over the expert-data-parallel ranks, the rest
    over DP x CP; biases left out: a floor)."""
    bare = _bare(shape)
    dense = _per_param(shape, plan, low_params, plan.dp * plan.cp)
    dense_layer = cp.layer_params(bare, plan.tp) * dense
    if not shape.moe.enabled:
        return dense_layer, dense_layer
    routed = cp.routed_params(bare, plan.tp, plan.ep)
    rest = cp.layer_params(bare, plan.tp, True, plan.ep) - routed
    expert = _per_param(shape, plan, low_params, plan.expert_dp)
    return dense_layer, rest * dense + routed * expert


def _kept(shape: ModelShape, plan: ParallelPlan, low: bool) -> tuple[float, float]:
    """(bytes each layer keeps at least for every micro-batch in flight, bytes the rank's running
    MoE layer adds for one micro-batch). Kept: its input (1 / TP of it with sequence
    parallelism, 1 / CP of the sequence), which even full recompute keeps. An MoE layer saves
    the tokens routed to its first expert projection for the weight gradient (1 byte each in a low
    precision) and that projection's output for the activation's backward (which recompute of the
    activation keeps as its input); the worst expert-parallel rank receives at least the mean, its
    own tokens times top-k (1 / TP of them: the expert TP taken as TP). So for every micro-batch
    when its experts are not recomputed, else while its forward is recomputed for the backward.
    Uniform recompute of g layers at a time keeps one
    input per g layers; fine-grained activation offloading keeps none."""
    if plan.ddp.activation_offload.fine_grained_activation_offloading:
        return 0.0, 0.0
    pbytes, rc, m = dtype_bytes(shape.dtype), plan.recompute, shape.moe
    tokens = plan.micro_batch_size * shape.seq_length / plan.cp
    hidden = tokens * shape.hidden_size * pbytes / (plan.tp if plan.sequence_parallel else 1)
    routed = 0.0
    if m.enabled and not m.moe_expert_capacity_factor:
        up = (2 if shape.gated else 1) * shape.moe_ffn  # the first projection's output
        per_token = shape.hidden_size * (1 if low else pbytes) + up * pbytes
        routed = tokens / plan.tp * m.moe_router_topk * per_token
    if rc.granularity == "full":
        if rc.method == "uniform" and rc.num_layers:
            return hidden / max(rc.num_layers), 0.0
        return hidden, routed
    if "moe" in rc.modules:
        return hidden, routed
    return hidden + routed, 0.0


def _logits(shape: ModelShape, plan: ParallelPlan) -> float:
    """Bytes of one micro-batch's logits on the last rank: the output layer's product, its
    vocabulary over TP, in the model's dtype."""
    tokens = plan.micro_batch_size * shape.seq_length / plan.cp
    return tokens * shape.padded_vocab(plan.tp) / plan.tp * dtype_bytes(shape.dtype)


def memory_floor(
    shape: ModelShape, plan: ParallelPlan, low_params: bool = False, low: bool = False
) -> float:
    """Bytes the most loaded rank of any layout of the plan's sizes holds at least: _layer_bytes
    per layer, plus _kept for every layer and every micro-batch in flight at the rank's first
    backward (min(PP - rank, m) under 1F1B; interleaved, each chunk's first micro-batch) and
    once for its running layer, the embedding and output layer on the end ranks, one
    micro-batch's logits on the last. The least worst rank over every placement of the layers
    (dense layers beside MoE ones left out), by bisection. `low`: the linear layers compute in a
    1-byte precision (Kernels.low_precision); `low_params`: their weights are 1-byte parameters
    (Kernels.low_precision_params)."""
    dense, moe = _layer_bytes(shape, plan, low_params)
    kept, running = _kept(shape, plan, low)
    pattern = shape.moe_layers if shape.moe.enabled else (False,) * shape.num_layers
    n, layer = (sum(pattern), moe) if any(pattern) else (shape.num_layers, dense)
    running = running if any(pattern) else 0.0
    per_param = _per_param(shape, plan, low_params, plan.dp * plan.cp)
    ends, per_layer = [], []
    for r in range(plan.pp):
        last = r == plan.pp - 1
        end = cp.end_params(shape, plan.tp, r == 0, last) * per_param
        ends.append(end + (_logits(shape, plan) if last else 0.0))
        flight = 1 if plan.vpp > 1 else min(plan.pp - r, plan.num_microbatches)
        per_layer.append(layer + flight * kept)

    def fits(limit: float) -> bool:
        held = [
            (limit - e - running) // w if limit >= e + running + w else (0 if limit >= e else -1)
            for e, w in zip(ends, per_layer)
        ]
        return min(held) >= 0 and sum(held) >= n

    lo, hi = 0.0, max(e + running + n * w for e, w in zip(ends, per_layer))
    while hi - lo > 1e-6 * hi:  # lo never fits: a floor at any precision
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return lo
