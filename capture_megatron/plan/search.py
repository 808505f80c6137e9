"""Plan: the memory-balanced partition for given parallel sizes, and the search over sizes.

For every candidate (TP, PP, DP, VPP, micro-batch, recompute, SP, distributed optimizer) the layers
are split by the exact min-max partitioner on the predictor's per-rank peaks; with full recompute
the per-stage recompute counts are then lowered, stage by stage, to the fewest that still fit the
memory cap (fewer recomputed layers, faster steps). Objectives: min-peak (CAPTURE), throughput
(fastest estimated step among plans that fit), min-gpus (fewest GPUs on which some plan fits).
Pure Python.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from capture_megatron.config import Cluster, ModelShape, ParallelPlan, Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel
from capture_megatron.plan.contiguous import contiguous_partition, descend
from capture_megatron.plan.costmodel import CostModel, step_seconds
from capture_megatron.plan.margins import Margins
from capture_megatron.plan.partition import (
    LocatedPeak,
    RankPeak,
    RankTable,
    Score,
    evaluate_located,
    min_max_partition,
)
from capture_megatron.plan.space import Space, candidates
from capture_megatron.plan.supply import Supply
from capture_megatron.predict import StageMemory, layers_for, mixed_layers, rank_memory
from capture_megatron.predict.table import peak_table

OBJECTIVES = ("min-peak", "throughput", "min-gpus")
"""What the search optimises (--objective)."""


@dataclass(frozen=True)
class Evaluated:
    """A candidate plan with its prediction."""

    plan: ParallelPlan
    """The plan (with its balanced layout and per-stage recompute)."""
    stages: tuple[StageMemory, ...]
    """Predicted peak and breakdown per pipeline rank."""
    peak: float
    """Worst rank's predicted peak (bytes)."""
    needed: float
    """Memory the worst rank needs with the allocator/context margin (bytes)."""
    fits: bool
    """needed <= the cluster's per-GPU memory."""
    step_seconds: float
    """Estimated step time."""

    @property
    def rank_peaks(self) -> tuple[int, ...]:
        """Predicted peak bytes of each pipeline rank (whole bytes)."""
        return tuple(int(s.peak) for s in self.stages)


def _every_layer(shape: ModelShape, plan: ParallelPlan) -> ParallelPlan:
    """The plan with every layer of every stage recomputed (more than any stage can hold)."""
    return replace(plan, recompute=Recompute("full", "block", (shape.num_layers,) * plan.pp))


def located_peak_fn(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, recompute_all: bool
) -> LocatedPeak:
    """peak(pp_rank, chunk_counts, chunk_starts) of the plan's sizes (full recompute of every
    layer if asked), memoised; the starts matter only when dense and MoE layers are mixed."""
    layers = layers_for(model, shape, plan)
    plan = _every_layer(shape, plan) if recompute_all else plan
    chunk_cache: dict = {}

    @functools.cache
    def peak(rank: int, counts: tuple[int, ...], starts: tuple[int, ...]) -> float:
        at = starts if layers.mixed else None
        return rank_memory(layers, shape, plan, rank, counts, chunk_cache, at).peak

    return peak


def rank_peak_fn(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, recompute_all: bool
) -> RankPeak:
    """rank_peak(pp_rank, chunk_counts) for the partitioner of identical layers (full recompute
    of every layer if asked)."""
    peak = located_peak_fn(model, shape, plan, recompute_all)
    return lambda rank, counts: peak(rank, counts, ())


def split_score_fn(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, recompute_all: bool
) -> Score:
    """score(layers_per_stage) -> the split's Partition at the plan's sizes (as rank_peak_fn)."""
    peak = located_peak_fn(model, shape, plan, recompute_all)
    return lambda split: evaluate_located(split, plan.pp, plan.vpp, peak)


def rank_table_fn(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, recompute_all: bool
) -> RankTable:
    """table(pp_rank, limit): rank_peak_fn's values for every chunk count up to `limit`, in bulk
    (capture_megatron.predict.table)."""
    layers = layers_for(model, shape, plan)
    plan = _every_layer(shape, plan) if recompute_all else plan
    chunk_cache: dict = {}

    def table(rank: int, limit: int) -> np.ndarray:
        return peak_table(layers, shape, plan, rank, limit, chunk_cache)

    return table


def _split(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, full: bool, unit: int
) -> tuple[int, ...]:
    """The min-max split of the plan's layers: exact for identical layers (any VPP) and for dense
    and MoE layers mixed with one chunk per rank; mixed with interleaving, the better of two local
    searches (contiguous.descend), from the exact split of layers all weighing what an MoE layer
    weighs and from the even split (not proven optimal)."""
    mixed = mixed_layers(shape)
    if mixed and plan.vpp == 1:
        peak = located_peak_fn(model, shape, plan, full)

        def range_peak(rank: int, start: int, k: int) -> float:
            return peak(rank, (k,), (start,))

        return contiguous_partition(shape.num_layers, plan.pp, range_peak, unit).layers_per_stage
    if mixed:  # from the split of layers all weighing an MoE layer's, and from the even split
        heavy = replace(shape, moe=replace(shape.moe, moe_layer_freq="1"))
        score = split_score_fn(model, shape, plan, full)
        stages, n = plan.pp * plan.vpp, shape.num_layers // unit
        even = tuple(unit * (n // stages + (i >= stages - n % stages)) for i in range(stages))
        starts = (_split(model, heavy, plan, full, unit), even)
        found = [descend(s, score, unit) for s in starts]
        return min(found, key=lambda p: p.peak).layers_per_stage
    return min_max_partition(
        shape.num_layers,
        plan.pp,
        plan.vpp,
        rank_peak_fn(model, shape, plan, full),
        unit,
        rank_table_fn(model, shape, plan, full),
    ).layers_per_stage


def _mtp_last_layer(shape: ModelShape, split: tuple[int, ...], unit: int) -> tuple[int, ...]:
    """`split` with a decoder layer (a unit of them) on the last stage when the model has MTP
    layers and the split left it none: megatron-core then puts the decoder's final norm on the
    stage holding the last decoder layer, which the memory model does not cover
    (config.mtp.mtp_problems); the unit comes from the nearest stage before that has one."""
    if not shape.mtp_num_layers or len(split) == 1 or split[-1]:
        return split
    layers = list(split)
    donor = max(i for i, n in enumerate(layers) if n >= unit)
    layers[donor] -= unit
    layers[-1] += unit
    return tuple(layers)


def balanced(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, keep_recompute: bool = False
) -> ParallelPlan:
    """The plan with its layers re-split by the min-max partition (_split; full recompute: every
    layer of each chunk recomputed, block method, for the trimming that follows; unless
    `keep_recompute`: the plan's own recompute is kept as given)."""
    full = plan.recompute.granularity == "full" and not keep_recompute
    rc = plan.recompute
    uniform = keep_recompute and rc.granularity == "full" and rc.method == "uniform"
    unit = max(rc.num_layers) if uniform else 1
    split = _split(model, shape, plan, full, max(unit, 1))
    plan = replace(plan, layers_per_stage=_mtp_last_layer(shape, split, max(unit, 1)))
    if full:
        plan = replace(
            plan,
            recompute=Recompute(
                "full", "block", tuple(max(plan.chunks_of(r)) for r in range(plan.pp))
            ),
        )
    return plan


def trim_recompute(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    cap: float,
    margins: Margins,
    floor: int = 0,
) -> ParallelPlan:
    """Lower each stage's full-recompute count to the fewest layers that keep it under `cap` (at
    least `floor`: 1 keeps full recompute that was given, 0 may drop it)."""
    if plan.recompute.granularity != "full":
        return plan
    layers = layers_for(model, shape, plan)
    counts = list(plan.recompute.num_layers)
    for r in range(plan.pp):
        while counts[r] > min(floor, max(plan.chunks_of(r))):
            trial = replace(
                plan,
                recompute=Recompute(
                    "full", "block", tuple(counts[:r] + [counts[r] - 1] + counts[r + 1 :])
                ),
            )
            if margins.needed(rank_memory(layers, shape, trial, r).peak) > cap:
                break
            counts[r] -= 1
    if not any(counts):
        return replace(plan, recompute=Recompute())
    return replace(plan, recompute=Recompute("full", "block", tuple(counts)))


def evaluate_plan(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    cluster: Cluster,
    margins: Margins,
    hw: CostModel,
) -> Evaluated:
    """Predict a fixed plan."""
    layers = layers_for(model, shape, plan)
    stages = tuple(rank_memory(layers, shape, plan, r) for r in range(plan.pp))
    peak = max(s.peak for s in stages)
    needed = margins.needed(peak)
    return Evaluated(
        plan,
        stages,
        peak,
        needed,
        needed <= cluster.gpu_memory_bytes,
        step_seconds(shape, plan, hw),
    )


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans of a search."""

    ranked: tuple[Evaluated, ...]
    """Fitting plans first, then by the objective."""
    considered: int
    """Candidates evaluated."""


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
) -> SearchResult:
    """Balance and predict the candidates; rank by the objective (fitting plans first).

    min-peak skips candidates another candidate dominates in memory (same sizes with a smaller
    micro-batch, without interleaving, or with full recompute, which keeps only each layer's input:
    larger micro-batches, interleaving and keeping more activations only add memory). throughput is
    a branch and bound: candidates in order of a step-time lower bound (step_seconds(bound=True)),
    stopping once `top` fitting plans are at least as fast as every bound left; a candidate is only
    balanced when its lighter twins fit (the same sizes without interleaving, and with full
    recompute trimmed to the fewest layers that fit: they need no more memory). `model` may be a
    Supply that profiles the pairs of the plans visited on demand (capture_megatron.plan.supply);
    min-peak asks for the pairs of every non-dominated candidate at once."""
    if objective not in OBJECTIVES:
        raise CaptureError(f"--objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    supply = model if isinstance(model, Supply) else Supply(shape, model)
    plans = list(candidates(shape, cluster, gbs, space))
    if objective == "throughput":
        floor, keep = (1 if space.recompute == ("full",) else 0), space.keeps_recompute
        return _fastest(supply, shape, cluster, plans, margins, hw, top, keep, floor)
    plans = [p for p in plans if not memory_dominated(p, space)]
    keep = space.keeps_recompute
    m = supply.complete(plans)
    results = [
        evaluate_plan(m, shape, balanced(m, shape, p, keep), cluster, margins, hw) for p in plans
    ]
    ranked = distinct(sorted(results, key=lambda e: (not e.fits, e.peak, e.step_seconds)))
    return SearchResult(ranked[:top], len(results))


def distinct(ranked: list[Evaluated]) -> tuple[Evaluated, ...]:
    """The ranking with each plan once: different candidates can balance to the same plan (full
    recompute trimmed to none is the plan without recompute); the first, best-ranked one stays."""
    seen: set[ParallelPlan] = set()
    out = []
    for e in ranked:
        if e.plan not in seen:
            seen.add(e.plan)
            out.append(e)
    return tuple(out)


def memory_dominated(plan: ParallelPlan, space: Space) -> bool:
    """Whether min-peak may skip `plan`: the space holds a twin that needs no more memory (a smaller
    micro-batch, no interleaving, full recompute)."""
    return (
        (plan.vpp > 1 and 1 in space.vpp)
        or plan.micro_batch_size > min(space.micro_batch_size)
        or (plan.recompute.granularity != "full" and "full" in space.recompute)
    )


def _fastest(
    supply: Supply,
    shape: ModelShape,
    cluster: Cluster,
    plans: list[ParallelPlan],
    margins: Margins,
    hw: CostModel,
    top: int,
    keep_recompute: bool,
    floor: int = 0,
) -> SearchResult:
    def sizes(p: ParallelPlan, recompute: str) -> tuple:
        return (p.tp, p.pp, p.dp, p.ep, p.micro_batch_size, recompute, p.sequence_parallel,
                p.distributed_optimizer)  # fmt: skip

    # the lightest twin: no interleaving and full recompute when the space has them
    flat = {sizes(p, p.recompute.granularity): p for p in plans if p.vpp == 1}
    light = {key: plan for key, plan in flat.items() if key[5] == "full"}
    done: dict[ParallelPlan, Evaluated] = {}
    order = sorted(plans, key=lambda p: step_seconds(shape, p, hw, bound=True))

    def twins(plan: ParallelPlan) -> list[ParallelPlan]:
        found = (light.get(sizes(plan, "full")), flat.get(sizes(plan, plan.recompute.granularity)))
        return [t for t in found if t is not None and t != plan]

    def upcoming(i: int) -> Iterator[ParallelPlan]:
        for plan in order[i:]:
            yield from twins(plan)
            yield plan

    def run(plan: ParallelPlan, i: int) -> Evaluated:
        if plan not in done:
            # full recompute may be trimmed to none: that plan's variant is predicted too
            trimmed = replace(plan, recompute=Recompute())
            may_trim = plan.recompute.granularity == "full" and not keep_recompute and not floor
            model = supply.model_for([plan, trimmed] if may_trim else [plan], upcoming(i))
            fitted = balanced(model, shape, plan, keep_recompute)
            if not keep_recompute:
                fitted = trim_recompute(
                    model, shape, fitted, cluster.gpu_memory_bytes, margins, floor
                )
            done[plan] = evaluate_plan(model, shape, fitted, cluster, margins, hw)
        return done[plan]

    for i, plan in enumerate(order):
        fitting = sorted({e.plan: e.step_seconds for e in done.values() if e.fits}.values())
        if len(fitting) >= top and fitting[top - 1] <= step_seconds(shape, plan, hw, bound=True):
            break
        if any(not run(t, i).fits for t in twins(plan)):
            continue
        run(plan, i)
    ranked = distinct(sorted(done.values(), key=lambda e: (not e.fits, e.step_seconds, e.peak)))
    return SearchResult(ranked[:top], len(done))
