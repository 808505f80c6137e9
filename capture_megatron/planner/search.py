"""Plan: the search over parallel sizes. Objectives: min-peak (CAPTURE: the memory-balanced split
of the candidate that needs the least memory), throughput (the fastest estimated step among plans
that fit: capture_megatron.planner.fastest, the time-aware split of capture_megatron.planner.timed),
min-gpus (fewest GPUs on which some plan fits). The memory side (a candidate predicted, the min-max
memory split, trimmed recompute) is capture_megatron.planner.balance. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from capture_megatron.config import Cluster, ModelShape, ParallelPlan
from capture_megatron.config.hf_count import parameter_count
from capture_megatron.errors import CaptureError
from capture_megatron.features.optimizer_offload import HOST_BYTES, HOST_STEP_BYTES
from capture_megatron.fit import MemoryModel
from capture_megatron.forecast.offload import measured
from capture_megatron.planner.balance import (
    Evaluated,
    balanced,
    distinct,
    evaluate_plan,
    located_peak_fn,
    rank_peak_fn,
    rank_table_fn,
    split_score_fn,
    trim_recompute,
)
from capture_megatron.planner.fastest import SearchResult, fastest, throughput_key
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.offload_space import (
    activation_ddp,
    activation_rank,
    fsdp_twin,
    offload_ddp,
    offloaded,
)
from capture_megatron.planner.sidebyside import side_by_side
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.stepbound import step_bound
from capture_megatron.planner.supply import Supply, Unrecorded
from capture_megatron.steptime.model import CostModel

__all__ = [
    "OBJECTIVES",
    "Evaluated",
    "SearchResult",
    "Space",
    "balanced",
    "distinct",
    "evaluate_plan",
    "located_peak_fn",
    "memory_dominated",
    "rank_peak_fn",
    "rank_table_fn",
    "search",
    "split_score_fn",
    "trim_recompute",
    "undominated",
]

OBJECTIVES = ("min-peak", "throughput", "min-gpus")
"""What the search optimises (--objective)."""


def search(
    model: MemoryModel | Supply,
    shape: ModelShape,
    cluster: Cluster,
    gbs: int,
    space: Space,
    objective: str,
    margins: Margins,
    hw: CostModel = CostModel(),
    top: int = 10,
    low_precision: tuple[bool, bool] = (False, False),
) -> SearchResult:
    """Balance and predict the candidates; rank by the objective (fitting plans first).

    min-peak skips candidates another candidate dominates in memory (same sizes with a smaller
    micro-batch, without interleaving, or with full recompute, which keeps only each layer's input:
    larger micro-batches, interleaving and keeping more activations only add memory) and splits
    each by the min-max memory partition. throughput is the branch and bound of
    capture_megatron.planner.fastest. `model` may be a Supply that profiles the pairs of the plans
    visited on demand (capture_megatron.planner.supply); min-peak asks for the pairs of every
    non-dominated candidate at once. `low_precision`: (Kernels.low_precision,
    Kernels.low_precision_params), the memory floor's activation and parameter bytes."""
    if objective not in OBJECTIVES:
        raise CaptureError(f"--objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    supply = model if isinstance(model, Supply) else Supply(shape, model)
    keep = space.keeps_recompute
    if objective == "throughput":
        floor, low = 1 if space.recompute == ("full",) else 0, low_precision

        def run(some: list[ParallelPlan], beaten: float = math.inf) -> SearchResult:
            return fastest(supply, shape, cluster, some, margins, hw, top, keep, floor, low, beaten)

        moved = [f for f in space.optimizer_offload if f > 0.0]
        if len(space.optimizer_offload) < 2 or True not in space.distributed_optimizer:
            moved = []
        sets = [s for s in space.activation_offload if s]
        bare = replace(space, activation_offload=((),)) if moved or sets else space
        bare = replace(bare, optimizer_offload=(0.0,)) if moved else bare
        plain = list(candidates(shape, cluster, gbs, bare))
        first = run(plain)
        groups, best = _offload_groups(supply, cluster, plain, first, (moved, sets), hw)
        fsdp = True in space.fsdp
        return _twins_searched(run, supply, hw, plain, first, (groups, best), fsdp, top)
    plans = undominated(list(candidates(shape, cluster, gbs, space)))
    m = supply.complete(plans)
    if len(space.activation_offload) > 1 and not measured(m):  # the same pairs without it
        space = replace(space, activation_offload=((),))
        plans = undominated(list(candidates(shape, cluster, gbs, space)))
    results = [
        evaluate_plan(m, shape, balanced(m, shape, p, keep), cluster, margins, hw) for p in plans
    ]
    ranked = distinct(sorted(results, key=lambda e: (not e.fits, e.peak, e.step_seconds)))
    return SearchResult(ranked[:top], len(results))


def _offload_groups(
    supply: Supply,
    cluster: Cluster,
    plain: list[ParallelPlan],
    first: SearchResult,
    offloads: tuple[list[float], list[tuple[str, ...]]],
    hw: CostModel,
) -> tuple[list[list[ParallelPlan]], float]:
    """throughput with offload searched (`offloads`: the optimizer fractions above 0 and the
    activation offload module sets): after the fastest plan without offload (`first`), the
    offloading twins (offloading_twins) of the candidates found not to fit without it whose step
    bound is below that plan (none when it is at least as fast as every bound: offload only adds
    step time, so it wins where it saves recompute or stages), in the groups searched apart (all
    in one where no node's host memory can bind, else each fraction apart: more offload is then
    not lighter), with that plan's step, which each search's splits must beat. No activation
    offload where the memory model does not say what it moves (predict.offload.measured)."""
    best = first.ranked[0].step_seconds if first.ranked and first.ranked[0].fits else math.inf
    order = {p: i for i, p in enumerate(plain)}  # the candidates' order, not the set's
    fractions, sets = offloads
    shape = supply.shape
    if sets and first.unfit:  # one pair (profiled already where one is) says whether the
        # source's records measure what activation offloading moves
        unfit = sorted(first.unfit, key=lambda p: (not supply.holds([p]), order[p]))
        sets = sets if measured(supply.complete(unfit[:1])) else []
    moved = [
        t
        for p in sorted(first.unfit, key=order.__getitem__)
        for t in offloading_twins(p, fractions, sets, lambda t: step_bound(shape, t, hw) < best)
    ]
    if not moved:
        return [], best
    bound = all(_host_bound(shape, p, cluster) <= hw.hardware.host_memory_bytes for p in moved)
    if bound and not sets:
        return [moved], best  # a fraction's twin all offloaded needs no more memory
    groups = [[p for p in moved if offloaded(p) == f] for f in (0.0, *fractions)]
    return [group for group in groups if group], best


def _with_offload(first: SearchResult, found: list[SearchResult], top: int) -> SearchResult:
    """The offloading twins' searches (`found`) merged into the ranking without offload."""
    if not found:
        return first
    both = sorted([e for r in (first, *found) for e in r.ranked], key=throughput_key)
    return SearchResult(distinct(both)[:top], sum(r.considered for r in (first, *found)))


def _twins_searched(
    run: Callable[[list[ParallelPlan], float], SearchResult],
    supply: Supply,
    hw: CostModel,
    plain: list[ParallelPlan],
    first: SearchResult,
    offload: tuple[list[list[ParallelPlan]], float],
    fsdp: bool,
    top: int,
) -> SearchResult:
    """The offloading twins' searches (`offload`: their groups and the step they must beat) and,
    with `fsdp`, the ZeRO-3 twins' (_fsdp_twins), merged into `first`'s ranking. Where the memory
    model holds what they need without profiling, they run side by side (planner.sidebyside; a
    search that needs profiling is run again here, profiling), the ZeRO-3 search with `first`'s
    mark, searched again with the offloading searches' own where they beat `first`: the results
    of running them one after the other."""
    groups, best = offload
    shape = supply.shape
    twins = _fsdp_twins(shape, plain, first, hw) if fsdp else ([], math.inf)
    zero3 = [twins] if twins[0] else []  # first: the most candidates, the longest search
    jobs = [*zero3, *((g, best) for g in groups)]
    if len(jobs) > 1:
        work = sum(len(plans) for plans, _ in jobs)
        tried = side_by_side(
            [partial(_recorded, supply, run, *job) for job in jobs], work, supply.go_offline
        )
        found = [f if f is not None else run(*job) for f, job in zip(tried, jobs, strict=True)]
        result = _with_offload(first, found[len(zero3) :], top)
        if fsdp and _fsdp_mark(result) == twins[1]:
            return _with_fsdp(result, found[: len(zero3)], twins[1], top)
    else:
        result = _with_offload(first, [run(g, best) for g in groups], top)
    if not fsdp:
        return result
    again = twins if _fsdp_mark(result) == twins[1] else _fsdp_twins(shape, plain, result, hw)
    return _with_fsdp(result, [run(*again)] if again[0] else [], again[1], top)


def _recorded(
    supply: Supply,
    run: Callable[[list[ParallelPlan], float], SearchResult],
    plans: list[ParallelPlan],
    beaten: float,
) -> SearchResult | None:
    """run(plans, beaten) where it profiles nothing (in a fork, side_by_side: an offline Supply),
    else None (its parent searches them, profiling)."""
    try:
        return run(plans, beaten)
    except Unrecorded:
        return None


FSDP_MARGIN = 0.05
"""How much faster than the fastest plan without it a Megatron-FSDP plan must be estimated to be
taken: no measured Megatron-FSDP step calibrates its per-layer gathers and reduce-scatters
(bench/data's development rows all run Megatron's DDP), so the search keeps the distributed
optimizer, which they measure, unless ZeRO-3 is ahead by more than the dense rows' median error
(3.2%, docs/STEP_TIME.md) rounded up."""


def _fsdp_twins(
    shape: ModelShape, plain: list[ParallelPlan], result: SearchResult, hw: CostModel
) -> tuple[list[ParallelPlan], float]:
    """Megatron-FSDP's ZeRO-3 tried: (the ZeRO-3 twins (offload_space.fsdp_twin) of the candidates
    without offload whose step bound is below the mark, the mark: FSDP_MARGIN under `result`'s
    fastest plan). Their sharded weights, gradients and optimizer state leave room for larger
    micro-batches, less recompute or fewer stages."""
    mark = _fsdp_mark(result)
    twins = [t for t in map(fsdp_twin, plain) if t is not None]
    return [t for t in twins if step_bound(shape, t, hw) < mark], mark


def _fsdp_mark(result: SearchResult) -> float:
    """The step a ZeRO-3 plan must beat: FSDP_MARGIN under `result`'s fastest fitting plan (inf
    where none fits)."""
    top_step = result.ranked[0].step_seconds if result.ranked and result.ranked[0].fits else None
    return math.inf if top_step is None else top_step * (1 - FSDP_MARGIN)


def _with_fsdp(
    result: SearchResult, found: list[SearchResult], mark: float, top: int
) -> SearchResult:
    """The ZeRO-3 twins' search (`found`: none or one, split against `mark`) merged into
    `result`: its plans that fit and beat the mark (all that fit where nothing fits without
    it)."""
    if not found:
        return result
    wins = [e for e in found[0].ranked if e.fits and e.step_seconds < mark]
    both = sorted([*result.ranked, *wins], key=throughput_key)
    return SearchResult(distinct(both)[:top], result.considered + found[0].considered, result.unfit)


def offloading_twins(
    plan: ParallelPlan,
    fractions: list[float],
    sets: Sequence[tuple[str, ...]] = (),
    may_win: Callable[[ParallelPlan], bool] = lambda _: True,
) -> list[ParallelPlan]:
    """`plan` offloading each fraction of its optimizer, with the distributed optimizer (which
    the precision-aware optimizer needs), less those Megatron refuses; and, without full
    recompute, `plan` and each of those offloading the activations of each module set; only
    those of a plan (`plan` or a fraction's twin) that `may_win` (activation offload only adds
    step time, so its twins may win only where that plan may)."""
    out = []
    for f in fractions:
        try:
            ddp = offload_ddp(plan.ddp, f)
            out.append(replace(plan, distributed_optimizer=True, ddp=ddp))
        except CaptureError:
            continue
    bases = [p for p in (plan, *out) if may_win(p)]
    moved = [] if plan.recompute.granularity == "full" else bases
    return [p for p in bases if p is not plan] + [
        replace(p, ddp=activation_ddp(p.ddp, s)) for p in moved for s in sets
    ]


def _host_bound(shape: ModelShape, plan: ParallelPlan, cluster: Cluster) -> float:
    """No fewer host bytes than a node's ranks take with all of their optimizer offloaded: per
    element of 1 / (TP x DP x CP) of the model's parameters (a rank's owned share at most, 10%
    over for the norms TP does not split) 16 bytes (HOST_BYTES) and a slice's 4-byte step (at
    most one slice per element), on each of the node's GPUs."""
    share = 1.1 * parameter_count(shape) / (plan.tp * plan.dp * plan.cp)
    return min(cluster.gpus_per_node, cluster.gpus) * (HOST_BYTES + HOST_STEP_BYTES) * share


def _sizes(p: ParallelPlan) -> tuple:
    """What a candidate has besides its micro-batch, interleaving and recompute."""
    return (p.tp, p.pp, p.dp, p.cp, p.ep, p.sequence_parallel, p.distributed_optimizer)


def undominated(plans: list[ParallelPlan]) -> list[ParallelPlan]:
    """The candidates min-peak keeps: those with no twin among `plans` that needs no more memory
    (memory_dominated)."""
    lightest: dict[tuple, Lightest] = {}
    for p in plans:
        full = p.recompute.granularity != "full"
        light = (p.micro_batch_size, p.vpp, full, offloaded(p), activation_rank(p.ddp))
        have = lightest.get(_sizes(p), light)
        lightest[_sizes(p)] = (
            min(have[0], light[0]),
            min(have[1], light[1]),
            have[2] and light[2],
            max(have[3], light[3]),
            max(have[4], light[4]),
        )
    return [p for p in plans if not memory_dominated(p, lightest[_sizes(p)])]


Lightest = tuple[int, int, bool, float, int]
"""What needs the least memory among the twins of one set of sizes: (the smallest micro-batch,
the fewest virtual stages, whether no twin recomputes in full, the largest optimizer offload
fraction, the most activations offloaded: offload_space.activation_rank)."""


def memory_dominated(plan: ParallelPlan, lightest: Lightest) -> bool:
    """Whether min-peak may skip `plan`: its sizes have a twin that needs no more device memory (a
    smaller micro-batch, no interleaving, full recompute where the plan offloads no activations,
    more of the optimizer offloaded, more activations offloaded; full recompute and activation
    offload are not compared: a dense layer's MLP keeps its activations under offload)."""
    mbs, vpp, no_full, moved, acted = lightest
    rank, full = activation_rank(plan.ddp), plan.recompute.granularity == "full"
    return (
        plan.micro_batch_size > mbs
        or plan.vpp > vpp
        or (not full and not no_full and not rank)
        or offloaded(plan) < moved
        or (not full and rank < acted)
    )
