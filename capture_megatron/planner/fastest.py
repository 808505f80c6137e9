"""The throughput objective's search: the fastest estimated step among plans that fit, by branch and
bound over the candidates of the space. Pure Python.

Candidates are visited in order of a lower bound on their step (stepbound.step_bound:
no layout or recompute setting of their sizes is faster; refined by ranktimes.least_step -- whole
layers, the output layer on the last rank -- before a candidate is split), and the search stops once
a fitting plan is at least as fast as every bound left: the whole space is searched without
evaluating most of it (the other plans ranked are the fastest evaluated on the way). A candidate is
split by the time-aware partition (planner.timed: the fastest layout that fits, each
stage's full recompute the fewest layers that fit), and only when its lighter twins fit (memory
dominance: the same sizes without interleaving, with the next smaller micro-batch, with full
recompute of every layer; a twin that does not fit means no layout of the candidate fits; nor is a
candidate whose parameters, gradients, optimizer share and layer inputs alone exceed the memory,
ranktimes.memory_floor). Where recompute is searched, full recompute with chosen counts covers no
recompute (every count 0), so candidates without recompute are not split separately. Dense and MoE
layers mixed keep the min-max memory split with trimmed recompute.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from capture_megatron.config import Cluster, DdpOptions, ModelShape, ParallelPlan, Recompute
from capture_megatron.features.activation_offload import OFFLOAD_SETS
from capture_megatron.fit import MemoryModel
from capture_megatron.forecast import mixed_layers
from capture_megatron.forecast.chunkmemo import ChunkMemos
from capture_megatron.planner.balance import (
    Evaluated,
    balanced,
    distinct,
    evaluate_plan,
    trim_recompute,
)
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.offload_space import activation_ddp, activation_rank
from capture_megatron.planner.partition import TIE
from capture_megatron.planner.ranktimes import least_step, lower_bound, memory_floor
from capture_megatron.planner.stepbound import bound_parts, step_bound
from capture_megatron.planner.supply import Supply
from capture_megatron.planner.timed import Beaten, timed_split
from capture_megatron.steptime.model import CostModel, overhead_per_pass


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans of a search."""

    ranked: tuple[Evaluated, ...]
    """Fitting plans first, then by the objective."""
    considered: int
    """Candidates evaluated."""
    unfit: frozenset[ParallelPlan] = frozenset()
    """The candidates found not to fit (throughput: their memory floor, a lighter twin or their
    own forecast), for plan.search's optimizer offload."""


def throughput_key(e: Evaluated) -> tuple:
    """The throughput ranking: fitting plans first, then the step; at the same step the plan
    offloading fewer activations (transfers compute hides cost nothing), then the peak."""
    return (not e.fits, e.step_seconds, activation_rank(e.plan.ddp), e.peak)


def _key(p: ParallelPlan) -> tuple:
    return (p.tp, p.pp, p.dp, p.cp, p.ep, p.vpp, p.micro_batch_size, p.recompute.granularity,
            p.sequence_parallel, p.distributed_optimizer, p.ddp)  # fmt: skip


def _all_offloaded(p: ParallelPlan) -> DdpOptions | None:
    """The settings of p's twin with all of its optimizer offloaded (None: p offloads none or all;
    plan.search puts such twins in one search only where no node's host memory can overflow)."""
    ddp = p.ddp
    moved = ddp.optimizer_cpu_offload and ddp.optimizer_offload_fraction < 1.0
    return replace(ddp, optimizer_offload_fraction=1.0) if moved else None


@dataclass(frozen=True)
class Fitted:
    """A candidate split and predicted (fit_plan)."""

    evaluated: Evaluated | None
    """The plan with its layout and recompute, predicted (None: no split that fits beats the step
    it had to, timed.Beaten; whether one fits is not known)."""
    bottleneck: float
    """The least slowest-rank per-micro-batch time of any split of its sizes that fits
    (timed.TimedSplit.bottleneck; inf when none fits, 0 when the layout was not chosen for time;
    a lower bound on it when `evaluated` is None)."""


def fit_plan(
    model_for: Callable[[list[ParallelPlan]], MemoryModel],
    shape: ModelShape,
    plan: ParallelPlan,
    cluster: Cluster,
    margins: Margins,
    hw: CostModel,
    keep_recompute: bool,
    floor: int = 0,
    memos: ChunkMemos | None = None,
    beat: float = math.inf,
) -> Fitted:
    """A candidate split for time (timed_split; full recompute's counts chosen unless kept), or,
    for dense and MoE layers mixed or uniform recompute given, by the min-max memory partition
    (recompute trimmed to the fewest layers that fit), and predicted; when no split fits, its
    even split with every layer recomputed (which does not fit either). `model_for(plans)`: a
    memory model that predicts those plans (the variant without recompute is asked for only when
    the chosen counts are all 0); `memos`: chunk costs shared with the search's other plans
    (timed.ChunkMemos); `beat`: a split for time is searched only as far as it may be faster
    than this step (Fitted.evaluated None where it cannot)."""
    rc = plan.recompute
    choose = rc.granularity == "full" and not keep_recompute
    uniform = rc.granularity == "full" and rc.method == "uniform"
    cap, model = cluster.gpu_memory_bytes, model_for([plan])
    if not mixed_layers(shape) and not uniform and not shape.mtp_num_layers:
        found = timed_split(model, shape, plan, cap, margins, hw, choose, floor, memos, beat)
        if isinstance(found, Beaten):
            return Fitted(None, found.bottleneck)
        if found is None:  # no split fits: the even one with every layer recomputed says so
            every = balanced(model, shape, plan, keep_recompute, even=True)
            return Fitted(evaluate_plan(model, shape, every, cluster, margins, hw), float("inf"))
        e = evaluate_plan(model_for([found.plan]), shape, found.plan, cluster, margins, hw)
        if e.fits or not choose or found.plan.recompute.granularity == "full":
            return Fitted(replace(e, bound=found.bound), found.bottleneck)
        # no recompute fits by the full variant's forecast but not by its own: keep one layer
        again = fit_plan(model_for, shape, plan, cluster, margins, hw, keep_recompute, 1,
                         memos, beat)  # fmt: skip
        return Fitted(again.evaluated, found.bottleneck)
    if choose and not floor:
        model = model_for([plan, replace(plan, recompute=Recompute())])
    fitted = balanced(model, shape, plan, keep_recompute, memos=memos)
    if not keep_recompute:
        fitted = trim_recompute(model, shape, fitted, cap, margins, floor, memos)
    return Fitted(evaluate_plan(model, shape, fitted, cluster, margins, hw), 0.0)


class _Visit:
    """The candidates of one search, their bounds, lighter twins and evaluations."""

    def __init__(
        self,
        plans: list[ParallelPlan],
        bound: Callable[[ParallelPlan], float],
        floor: Callable[[ParallelPlan], bool],
        beaten: float = math.inf,
    ) -> None:
        self.floor, self.floors = floor, dict[ParallelPlan, bool]()
        self.beaten = beaten
        """A step known from elsewhere (another search's fastest plan): a candidate whose bound
        is not below it is not split."""
        self.index = {_key(p): p for p in plans}
        self.sizes = sorted({p.micro_batch_size for p in plans})
        self.bounds = {p: bound(p) for p in plans}
        self.order = sorted(plans, key=self.bounds.__getitem__)
        self.done: dict[ParallelPlan, Evaluated] = {}
        self.passed: set[ParallelPlan] = set()
        """The plans whose split was left once no split of theirs could be faster than the
        fastest step known (a search given `beaten` only: a slower plan is not wanted)."""
        self.least: dict[ParallelPlan, float] = {}
        """Fitted.bottleneck of the plans split (or passed)."""
        self.fitting: set[ParallelPlan] = set()
        """The fitting splits found."""
        self.steps: list[float] = []
        """Those steps, sorted."""
        self.viable: dict[ParallelPlan, bool] = {}
        self.offloading: dict[ParallelPlan, ParallelPlan | None] = {}
        """more_offloaded's answers."""

    def twins(self, p: ParallelPlan) -> list[ParallelPlan]:
        """The candidates of the same sizes that need no more memory: without interleaving, with
        the next smaller micro-batch, with full recompute, with all of the optimizer offloaded."""
        k, moved = _key(p), _all_offloaded(p)
        smaller = [b for b in self.sizes if b < p.micro_batch_size]
        found = [
            self.index.get(k[:5] + (1,) + k[6:]) if p.vpp > 1 else None,
            self.index.get(k[:6] + (smaller[-1],) + k[7:]) if smaller else None,
            self.index.get(k[:7] + ("full",) + k[8:]) if k[7] != "full" else None,
            self.index.get(k[:-1] + (moved,)) if moved else None,
        ]
        return [t for t in found if t is not None]

    def more_offloaded(self, p: ParallelPlan) -> ParallelPlan | None:
        """p's twin offloading the largest module set of activations above p's, if a candidate
        (it needs no more device memory, though more host memory)."""
        if p not in self.offloading:
            self.offloading[p] = None
            k, rank = _key(p), activation_rank(p.ddp)
            for i in range(len(OFFLOAD_SETS), rank, -1):
                moved = activation_ddp(p.ddp, OFFLOAD_SETS[i - 1])
                twin = self.index.get(k[:-1] + (moved,))
                if twin is not None:
                    self.offloading[p] = twin
                    break
        return self.offloading[p]

    def floor_fits(self, p: ParallelPlan) -> bool:
        """Whether the plan's memory floor fits (the `floor` predicate, once per plan)."""
        if p not in self.floors:
            self.floors[p] = self.floor(p)
        return self.floors[p]

    def upcoming(self, i: int) -> Iterator[ParallelPlan]:
        """The candidates from the i-th on that may still be split -- their memory floor fits, no
        lighter twin is known not to fit, their bound is below the fastest plan found -- each
        after its twins (what profiling batches)."""
        known = self.fastest_known()
        for plan in self.order[i:]:
            if self.bounds[plan] >= known:
                break
            twins = self.twins(plan)
            if self.floor_fits(plan) and all(self.viable.get(t, True) for t in twins):
                yield from (t for t in twins if self.floor_fits(t))
                yield plan

    def unfit(self) -> frozenset[ParallelPlan]:
        """The candidates found not to fit."""
        return frozenset(p for p, ok in self.viable.items() if not ok)

    def cutoff(self) -> float:
        """The step a split must beat to be searched to its end: the fastest known where a
        step was given from elsewhere (the plans slower than it are not wanted), else inf."""
        return self.fastest_known() if self.beaten < math.inf else math.inf

    def add(self, plan: ParallelPlan, fitted: Fitted) -> None:
        """Record a candidate's split (its fastest step among the fitting ones, once per split)."""
        e, self.least[plan] = fitted.evaluated, fitted.bottleneck
        if e is None:
            self.passed.add(plan)
            return
        self.done[plan] = e
        self.passed.discard(plan)
        if e.fits and e.plan not in self.fitting:
            self.fitting.add(e.plan)
            bisect.insort(self.steps, e.step_seconds)

    def fastest_known(self) -> float:
        """The fastest step known: of the fitting plans found, or `beaten` (inf: neither)."""
        return min(self.steps[0], self.beaten) if self.steps else self.beaten


def _floor_fits(
    shape: ModelShape, plan: ParallelPlan, margins: Margins, cap: float, low: tuple[bool, bool]
) -> bool:
    """Whether the plan's memory floor (ranktimes.memory_floor) plus margins is within `cap`;
    `low`: (Kernels.low_precision, Kernels.low_precision_params)."""
    floor = memory_floor(shape, plan, low_params=low[1], low=low[0])
    return margins.plan_needed(floor, shape, plan) <= cap


@dataclass(frozen=True)
class _Problem:
    """What one search splits its candidates for."""

    supply: Supply
    shape: ModelShape
    cluster: Cluster
    margins: Margins
    hw: CostModel
    keep_recompute: bool
    floor: int
    memos: ChunkMemos
    """Chunk costs shared by the candidates split (timed.ChunkMemos)."""


class _BranchAndBound:
    """The search's steps over one _Visit (fastest)."""

    def __init__(self, problem: _Problem, visit: _Visit) -> None:
        self.p, self.visit = problem, visit

    def run(self, plan: ParallelPlan, i: int, beat: float = math.inf) -> Evaluated | None:
        """The plan split and predicted (fit_plan), once; None where no split of it can beat
        `beat` (it is not wanted, fitting or not: searched again, in full, when asked without)."""
        p, visit = self.p, self.visit
        if plan not in visit.done and (plan not in visit.passed or beat == math.inf):
            if plan.recompute.granularity == "full" and not p.keep_recompute:
                # its counts may all come out 0: that variant's pairs go with the next round
                p.supply.want([replace(plan, recompute=Recompute())])

            def model_for(plans: list[ParallelPlan]) -> MemoryModel:
                return p.supply.model_for(plans, visit.upcoming(i))

            fitted = fit_plan(model_for, p.shape, plan, p.cluster, p.margins, p.hw,
                              p.keep_recompute, p.floor, p.memos, beat)  # fmt: skip
            visit.add(plan, fitted)
        return visit.done.get(plan)

    def fits(self, plan: ParallelPlan, i: int, visited: bool = False) -> bool:
        """Whether the plan's floor of bytes can fit, every lighter twin that costs no profiling
        (recursively) fits, and then the plan itself; `visited` (the candidate the search is at,
        not a twin asked for): its split is searched only as far as it may beat the search's
        cutoff (_Visit.cutoff; where it cannot, True and nothing is known)."""
        visit = self.visit
        if plan not in visit.viable:
            ok = visit.floor_fits(plan) and all(self.fits(t, i) for t in self.twins(plan))
            more = visit.more_offloaded(plan)
            ok = ok and (more is None or self.on_device(more, i))
            e = self.run(plan, i, visit.cutoff() if visited else math.inf) if ok else None
            if ok and e is None:
                return True
            visit.viable[plan] = ok and e is not None and e.fits
        return visit.viable[plan]

    def on_device(self, plan: ParallelPlan, i: int) -> bool:
        """Whether the plan's device memory fits (its host memory aside: a twin offloading more
        activations needs more of it, so its overflow says nothing of the plan's)."""
        cap = self.p.cluster.gpu_memory_bytes
        if not self.visit.floor_fits(plan):
            return False
        e = self.run(plan, i)
        assert e is not None
        return e.needed <= cap

    def known(self, plan: ParallelPlan) -> bool:
        """Whether the plan is known or predicted without profiling (worth asking first)."""
        return plan in self.visit.viable or self.p.supply.holds([plan])

    def twins(self, plan: ParallelPlan) -> list[ParallelPlan]:
        """The lighter twins known, or predicted without profiling."""
        return [t for t in self.visit.twins(plan) if self.known(t)]

    def interleaved(self, plan: ParallelPlan, i: int) -> float | None:
        """A lower bound on an interleaved plan's step from its twin without interleaving, split
        first: interleaving only adds memory (the twins' rule), so its slowest rank takes at
        least the twin's least bottleneck plus its extra chunks' overhead (0: no twin split for
        time without profiling; None: the twin does not fit)."""
        twin = self.visit.index.get(_key(plan)[:5] + (1,) + _key(plan)[6:])
        if twin is None or not self.known(twin):
            return 0.0
        if not self.fits(twin, i):
            return None
        least = self.visit.least.get(twin, 0.0)
        if not least:
            return 0.0
        hw = self.p.hw
        extra = 2 * (plan.vpp - 1) * overhead_per_pass(hw)
        parts = bound_parts(self.p.shape, plan, hw)
        return lower_bound(parts, plan.num_microbatches, plan.vpp, least / (1 + TIE) + extra)

    def search(self) -> None:
        """Candidates by the cheap bound, refined (stage 1: least_step; 2: the twin without
        interleaving's least bottleneck) before a split; ends when no bound beats the fastest
        plan found."""
        visit, shape = self.visit, self.p.shape
        first = 0 if not mixed_layers(shape) else 2
        queue = [(visit.bounds[plan], first, i) for i, plan in enumerate(visit.order)]
        heapq.heapify(queue)
        while queue:
            bound, stage, i = heapq.heappop(queue)
            if visit.fastest_known() <= bound:
                break
            plan = visit.order[i]
            if stage == 0:
                heapq.heappush(queue, (max(bound, least_step(shape, plan, self.p.hw)), 1, i))
                continue
            twin_bound = self.interleaved(plan, i) if stage == 1 and plan.vpp > 1 else 0.0
            if stage == 1 and plan.vpp > 1 and twin_bound is not None:
                heapq.heappush(queue, (max(bound, twin_bound), 2, i))
            else:
                self.fits(plan, i, True)  # (twin_bound None: not viable: its twin does not fit)


def fastest(
    supply: Supply,
    shape: ModelShape,
    cluster: Cluster,
    plans: list[ParallelPlan],
    margins: Margins,
    hw: CostModel,
    top: int,
    keep_recompute: bool,
    floor: int = 0,
    low: tuple[bool, bool] = (False, False),
    beaten: float = math.inf,
) -> SearchResult:
    """The branch and bound (module docstring): the fastest fitting plan, proven, then the
    fastest of the others evaluated on the way (up to `top` in all; `low`: the kernels'
    low-precision compute and parameters, for the memory floor). With `beaten` (a step known from
    another search) only candidates that may be faster are split, each only as far as it may beat
    the fastest step known (timed.Beaten; its lighter twins, which say whether it can fit, in
    full): the fastest of them, if any is."""
    if "full" in {p.recompute.granularity for p in plans} and not keep_recompute and not floor:
        # full recompute's counts include 0 (no recompute); not with activation offload
        plans = [p for p in plans if p.recompute.granularity != "none" or activation_rank(p.ddp)]
    cap = cluster.gpu_memory_bytes
    visit = _Visit(plans, lambda p: step_bound(shape, p, hw),
                   lambda p: _floor_fits(shape, p, margins, cap, low), beaten)  # fmt: skip
    problem = _Problem(supply, shape, cluster, margins, hw, keep_recompute, floor, {})
    _BranchAndBound(problem, visit).search()
    done = visit.done.values()
    ranked = distinct(sorted(done, key=throughput_key))
    return SearchResult(ranked[:top], len(done), visit.unfit())
