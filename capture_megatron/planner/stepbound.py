"""Lower bounds on the estimated step (capture_megatron.steptime.model) over every layout and
recompute setting of a plan's sizes: what the throughput search stops on (capture_megatron.planner
.fastest) and what the time-aware partition proves its split against (capture_megatron.planner
.timed). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.steptime import parts as cp
from capture_megatron.steptime.model import (
    ROUNDING,
    CostModel,
    _dp_collectives,
    _optimizer,
    _p2p,
    _tied_embedding,
    overhead_per_pass,
)


@dataclass(frozen=True)
class BoundParts:
    """What no layout or recompute setting of a plan's sizes can undercut."""

    work: float
    """The ranks' least total per-micro-batch time: every layer's forward and backward without
    recompute, the output layer and loss, every chunk's overhead."""
    rest: float
    """The pipeline sends, the optimizer step of the mean rank's parameters (the largest rank
    holds no fewer), the tied embedding's all-reduce and the data-parallel collectives not
    overlapped."""
    hidden: tuple[tuple[float, float], ...]
    """(seconds, share) of the mean rank's overlapped data-parallel collectives: the gradient
    reduce hides behind one micro-batch's backward of its rank, the parameter gather behind its
    forward, no longer than `share` of the slowest rank's per-micro-batch time (the largest
    share of backward, or forward, of any piece of a rank's time)."""
    exposed_floor: float
    """The share of an overlapped collective never hidden (dp_overlap_exposed)."""

    def at(self, m: int, vpp: int, bottleneck: float) -> float:
        """The least step of a split whose slowest rank takes `bottleneck` seconds per
        micro-batch: (m - 1/v) B + W / v + rest + what the collectives leave exposed."""
        exposed = sum(max(self.exposed_floor * s, s - f * bottleneck) for s, f in self.hidden)
        return (m - 1 / vpp) * bottleneck + self.work / vpp + self.rest + exposed

    def least(self, m: int, vpp: int, bottleneck: float) -> float:
        """The least step of any split whose slowest rank takes `bottleneck` seconds or more: the
        step is convex and piecewise linear in B, so its least is at B or at a point where a
        collective's exposure stops shrinking."""
        bends = [s * (1 - self.exposed_floor) / f for s, f in self.hidden]
        return min(self.at(m, vpp, b) for b in [bottleneck, *(b for b in bends if b > bottleneck)])


def _shares(s: cp.Setting, shape: ModelShape, plan: ParallelPlan) -> tuple[float, float]:
    """(backward, forward): the largest share of backward, and of forward, in any piece of a
    rank's per-micro-batch time (a layer as the plan's recompute may run it, the output layer,
    a pass's overhead), so a rank's backward is no more than the first share of its time."""
    kinds = [cp.layer_time(s, shape, plan)]
    if shape.moe.enabled:
        kinds.append(cp.layer_time(s, shape, plan, moe=True))
    pieces = [(0.5, 0.5), cp.head_time(s, shape, plan)]
    for x in kinds:
        pieces.append((x.forward, x.backward + x.recomputed_forward))
        if plan.recompute.granularity == "full":
            pieces.append((x.forward, x.backward + x.forward))
    pieces = [(f, b) for f, b in pieces if f + b > 0]
    return max(b / (f + b) for f, b in pieces), max(f / (f + b) for f, b in pieces)


_BOUNDS: dict[tuple, BoundParts] = {}
"""bound_parts' answers by (shape, plan, model): the search asks for the same candidate's from
its order, its refinements and its offloading twins."""


def bound_parts(shape: ModelShape, plan: ParallelPlan, model: CostModel) -> BoundParts:
    """The parts of the lower bound of a plan's sizes (BoundParts; memoised)."""
    key = (shape, plan, model)
    found = _BOUNDS.get(key)
    if found is None:
        if len(_BOUNDS) >= cp.MEMO_LIMIT:
            _BOUNDS.clear()
        found = _BOUNDS[key] = _bound_parts(shape, plan, model)
    return found


def _bound_parts(shape: ModelShape, plan: ParallelPlan, model: CostModel) -> BoundParts:
    """bound_parts, computed."""
    s = model.setting
    kinds = [cp.layer_time(s, shape, plan)]
    if shape.moe.enabled:
        kinds.append(cp.layer_time(s, shape, plan, moe=True))
    moe = sum(shape.moe_layers) if shape.moe.enabled else 0
    counts = (shape.num_layers - moe, moe)  # dense, MoE layers
    work = sum(c * (k.forward + k.backward) for c, k in zip(counts, kinds))
    work += sum(cp.head_time(s, shape, plan)) + 2 * plan.pp * plan.vpp * overhead_per_pass(model)
    split = [cp.layer_param_split(shape, plan, bool(x)) for x in range(2)]
    params = sum(c * split[x][0] for x, c in enumerate(counts) if c)
    params = (params + cp.end_params(shape, plan.tp, True, True)) / plan.pp
    expert = sum(c * split[x][1] for x, c in enumerate(counts) if c) / plan.pp
    collectives = _dp_collectives(shape, plan, model, params, expert)
    rest = (
        _p2p(shape, plan, model)
        + sum(t for t, overlapped in collectives if not overlapped)
        + _optimizer(shape, plan, model, params, expert)
        + _tied_embedding(shape, plan, model)
    )
    windows = _shares(s, shape, plan)  # the reduce behind a backward, the gather a forward
    hidden = tuple((t, f) for (t, overlapped), f in zip(collectives, windows) if overlapped)
    return BoundParts(work, rest, hidden, s.k.dp_overlap_exposed)


def step_bound(shape: ModelShape, plan: ParallelPlan, model: CostModel | None = None) -> float:
    """A lower bound on the step of every layout and recompute setting of the plan's sizes (the
    search uses it to stop once no unexplored plan can be faster): the pipeline of equal stages
    of the mean rank's micro-batch time plus the parts no layout changes (bound_parts: the
    overlapped collectives hidden behind no more than the slowest rank's micro-batch).
    pipeline_seconds is m t_s + the others' slowest chunks, each at least their time / v, so
    >= (m - 1/v) t_s + (sum of the ranks' times) / v, and the slowest rank t_s is no faster than
    the mean."""
    model = model or CostModel()
    parts = bound_parts(shape, plan, model)
    return parts.least(plan.num_microbatches, plan.vpp, parts.work / plan.pp) * ROUNDING
