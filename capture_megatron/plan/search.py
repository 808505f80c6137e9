"""Plan: the search over parallel sizes. Objectives: min-peak (CAPTURE: the memory-balanced split
of the candidate that needs the least memory), throughput (the fastest estimated step among plans
that fit: capture_megatron.plan.fastest, the time-aware split of capture_megatron.plan.timed),
min-gpus (fewest GPUs on which some plan fits). The memory side (a candidate predicted, the min-max
memory split, trimmed recompute) is capture_megatron.plan.balance. Pure Python.
"""

from __future__ import annotations

from capture_megatron.config import Cluster, ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel
from capture_megatron.plan.balance import (
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
from capture_megatron.plan.costmodel import CostModel
from capture_megatron.plan.fastest import SearchResult, fastest
from capture_megatron.plan.margins import Margins
from capture_megatron.plan.space import Space, candidates
from capture_megatron.plan.supply import Supply

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
    fp8: tuple[bool, bool] = (False, False),
) -> SearchResult:
    """Balance and predict the candidates; rank by the objective (fitting plans first).

    min-peak skips candidates another candidate dominates in memory (same sizes with a smaller
    micro-batch, without interleaving, or with full recompute, which keeps only each layer's input:
    larger micro-batches, interleaving and keeping more activations only add memory) and splits
    each by the min-max memory partition. throughput is the branch and bound of
    capture_megatron.plan.fastest. `model` may be a Supply that profiles the pairs of the plans
    visited on demand (capture_megatron.plan.supply); min-peak asks for the pairs of every
    non-dominated candidate at once. `fp8`: FP8 compute and --fp8-param-gather (the memory
    floor's activation and parameter bytes)."""
    if objective not in OBJECTIVES:
        raise CaptureError(f"--objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    supply = model if isinstance(model, Supply) else Supply(shape, model)
    plans = list(candidates(shape, cluster, gbs, space))
    keep = space.keeps_recompute
    if objective == "throughput":
        floor = 1 if space.recompute == ("full",) else 0
        return fastest(supply, shape, cluster, plans, margins, hw, top, keep, floor, fp8)
    plans = undominated(plans)
    m = supply.complete(plans)
    results = [
        evaluate_plan(m, shape, balanced(m, shape, p, keep), cluster, margins, hw) for p in plans
    ]
    ranked = distinct(sorted(results, key=lambda e: (not e.fits, e.peak, e.step_seconds)))
    return SearchResult(ranked[:top], len(results))


def _sizes(p: ParallelPlan) -> tuple:
    """What a candidate has besides its micro-batch, interleaving and recompute."""
    return (p.tp, p.pp, p.dp, p.cp, p.ep, p.sequence_parallel, p.distributed_optimizer)


def undominated(plans: list[ParallelPlan]) -> list[ParallelPlan]:
    """The candidates min-peak keeps: those with no twin among `plans` that needs no more memory
    (memory_dominated)."""
    lightest: dict[tuple, tuple[int, int, bool]] = {}
    for p in plans:
        key, light = _sizes(p), (p.micro_batch_size, p.vpp, p.recompute.granularity != "full")
        have = lightest.get(key, light)
        lightest[key] = (min(have[0], light[0]), min(have[1], light[1]), have[2] and light[2])
    return [p for p in plans if not memory_dominated(p, lightest[_sizes(p)])]


def memory_dominated(plan: ParallelPlan, lightest: tuple[int, int, bool]) -> bool:
    """Whether min-peak may skip `plan`: its sizes have a twin that needs no more memory (a smaller
    micro-batch, no interleaving, full recompute); `lightest`: (the smallest micro-batch, the
    fewest virtual stages, whether no twin recomputes in full) among the twins."""
    mbs, vpp, no_full = lightest
    return (
        plan.micro_batch_size > mbs
        or plan.vpp > vpp
        or (plan.recompute.granularity != "full" and not no_full)
    )
