"""Pipeline ranks' per-micro-batch times for the time-aware partition (capture_megatron.plan.timed):
what a rank holding k identical layers takes (costmodel.chunk_seconds), the chunk splits searched,
and the least bottleneck and step any split can have when memory is no bound (the search's refined
lower bound). Pure Python."""

from __future__ import annotations

from dataclasses import replace

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.config.ddp import STATE_BYTES
from capture_megatron.plan import costparts as cp
from capture_megatron.plan.costmodel import ROUNDING, CostModel, bound_parts
from capture_megatron.plan.partition import TIE

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
        self.overhead = s.k.chunk_overhead
        selective = plan.recompute.granularity == "selective"
        self.per_layer = (
            self.layer.forward
            + self.layer.backward
            + (self.layer.recomputed_forward if selective else 0.0)
        )
        """A layer's forward and backward (selective recompute's modules again)."""

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
        in (below, at], within TIE."""
        pp, n = self.plan.pp, self.shape.num_layers
        lo, hi = 0.0, max(self.unrecomputed(r, n) for r in range(pp))
        for _ in range(200):
            if hi - lo <= TIE * hi:
                break
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if sum(self.held(r, mid) for r in range(pp)) >= n else (mid, hi)
        return lo, hi


def least_step(shape: ModelShape, plan: ParallelPlan, hw: CostModel) -> float:
    """A lower bound on the step of any split and recompute of the plan's sizes (layers of one
    kind): the least bottleneck without memory in the module docstring's bound. Tighter than
    costmodel.step_seconds(bound=True) (whole layers; the output layer on the last rank)."""
    parts = bound_parts(shape, plan, hw)
    least = RankTimes(shape, plan, hw).least_bottleneck()[0]
    return lower_bound((parts.work, parts.rest), plan.num_microbatches, plan.vpp, least)


def lower_bound(parts: tuple[float, float], m: int, vpp: int, bottleneck: float) -> float:
    """The least step of any split whose slowest rank takes `bottleneck` (module docstring);
    `parts`: (W, rest)."""
    return ((m - 1 / vpp) * bottleneck + parts[0] / vpp + parts[1]) * ROUNDING


def _per_param(shape: ModelShape, plan: ParallelPlan, fp8_params: bool) -> float:
    """Bytes a dense parameter takes at least: itself (1 byte as an FP8 parameter), its gradient
    buffer's element (DdpOptions.grad_dtype) and its rank's share of the Adam moments (fp32, or
    the precision-aware optimizer's dtypes; the master weights left out; with
    --optimizer-cpu-offload only the share kept on the device)."""
    ddp = plan.ddp
    pbytes = 1 if fp8_params else dtype_bytes(shape.dtype)
    gbytes = dtype_bytes(ddp.grad_dtype(shape.dtype))
    moments = STATE_BYTES[ddp.exp_avg_dtype] + STATE_BYTES[ddp.exp_avg_sq_dtype]
    if not ddp.use_precision_aware_optimizer:
        moments = 4  # two moments of at least 16 bits (fp32 ones and master weights take more)
    kept = 1.0 - ddp.optimizer_offload_fraction if ddp.optimizer_cpu_offload else 1.0
    shards = plan.dp * plan.cp // ddp.num_distributed_optimizer_instances
    return pbytes + gbytes + kept * moments / (shards if plan.distributed_optimizer else 1)


def static_floor(shape: ModelShape, plan: ParallelPlan, fp8_params: bool = False) -> float:
    """Bytes the most loaded rank of any layout of the plan's sizes holds at least, before any
    activation: the mean rank's parameters, their gradients and (dense models) a share of the
    Adam moments (_per_param; `fp8_params`: --fp8-param-gather). Lets the search drop sizes that
    cannot fit without profiling them."""
    pattern = shape.moe_layers if shape.moe.enabled else (False,) * shape.num_layers
    bare = replace(shape, add_bias_linear=False)  # biases left out: a floor
    params = sum(cp.layer_params(bare, plan.tp, x, plan.ep) for x in pattern)
    params += cp.end_params(bare, plan.tp, True, True)
    per_param = _per_param(shape, plan, fp8_params)
    if shape.moe.enabled:  # expert state is sharded over the expert-data-parallel ranks
        per_param = (1 if fp8_params else dtype_bytes(shape.dtype)) + dtype_bytes(
            plan.ddp.grad_dtype(shape.dtype)
        )
    return params / plan.pp * per_param


def memory_floor(shape: ModelShape, plan: ParallelPlan, fp8_params: bool = False) -> float:
    """Bytes the most loaded rank of any layout of the plan's sizes holds at least (one chunk per
    rank; static_floor with more): static_floor's bytes per parameter, plus, for every layer and
    every micro-batch in flight under 1F1B (min(PP - rank, m) on a rank), the layer's input, which
    even full recompute of every layer keeps (1 / TP of it with sequence parallelism, 1 / CP of
    the sequence). The least worst rank over every split of the layers, by bisection. Uniform
    recompute of several layers at a time keeps one input per group: static_floor alone."""
    rc = plan.recompute
    grouped = rc.granularity == "full" and rc.method == "uniform" and max(rc.num_layers) > 1
    if plan.vpp > 1 or shape.moe.enabled or grouped:
        return static_floor(shape, plan, fp8_params)
    pbytes = dtype_bytes(shape.dtype)
    per_param = _per_param(shape, plan, fp8_params)
    tokens = plan.micro_batch_size * shape.seq_length / plan.cp
    hidden = tokens * shape.hidden_size * pbytes / (plan.tp if plan.sequence_parallel else 1)
    bare = replace(shape, add_bias_linear=False)  # biases left out: a floor
    layer = cp.layer_params(bare, plan.tp) * per_param
    ends, per_layer = [], []
    for r in range(plan.pp):
        ends.append(cp.end_params(shape, plan.tp, r == 0, r == plan.pp - 1) * per_param)
        per_layer.append(layer + min(plan.pp - r, plan.num_microbatches) * hidden)
    n = shape.num_layers

    def fits(limit: float) -> bool:
        held = [(limit - e) // w if limit >= e else -1 for e, w in zip(ends, per_layer)]
        return min(held) >= 0 and sum(held) >= n

    lo, hi = 0.0, max(e + n * w for e, w in zip(ends, per_layer))
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return lo
