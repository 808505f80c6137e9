"""The memory side of planning: a candidate predicted (Evaluated), the min-max memory split of its
layers (balanced: exact for identical layers at any VPP and for dense and MoE layers mixed with one
chunk per rank), and full recompute trimmed to the fewest layers per stage that fit. Pure Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan, Recompute
from capture_megatron.fit import MemoryModel
from capture_megatron.forecast import StageMemory, layers_for, mixed_layers, rank_memory, rank_peak
from capture_megatron.forecast.chunkmemo import ChunkMemos, chunk_memo
from capture_megatron.forecast.layers import Layers
from capture_megatron.forecast.rows import peak_rows
from capture_megatron.forecast.table import peak_table
from capture_megatron.planner.contiguous import contiguous_partition, descend
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.partition import (
    LocatedPeak,
    RankPeak,
    RankRows,
    RankTable,
    Score,
    evaluate_located,
    min_max_partition,
)
from capture_megatron.steptime.model import CostModel, step_seconds


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
    bound: float = 0.0
    """No layout of the plan's sizes and recompute granularity that fits is estimated faster than
    this (seconds; capture_megatron.planner.timed); 0 when the layout was not chosen for time."""
    host_per_node: float = 0.0
    """--optimizer-cpu-offload: host bytes of one node's ranks (its GPUs x the largest rank's host
    bytes); a plan fits only if they are within the hardware's host memory (--host-memory-gib)."""

    @property
    def rank_peaks(self) -> tuple[int, ...]:
        """Predicted peak bytes of each pipeline rank (whole bytes)."""
        return tuple(int(s.peak) for s in self.stages)


def _every_layer(shape: ModelShape, plan: ParallelPlan) -> ParallelPlan:
    """The plan with every layer of every stage recomputed (more than any stage can hold)."""
    return replace(plan, recompute=Recompute("full", "block", (shape.num_layers,) * plan.pp))


def _prepared(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    recompute_all: bool,
    memos: ChunkMemos | None,
) -> tuple[Layers, ParallelPlan, dict]:
    """What the peak functions below forecast with: the plan's layers, the plan (full recompute
    of every layer if asked) and its chunk-cost memo (shared through `memos`)."""
    layers = layers_for(model, shape, plan)
    plan = _every_layer(shape, plan) if recompute_all else plan
    return layers, plan, chunk_memo(memos, layers, plan)


def located_peak_fn(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    recompute_all: bool,
    memos: ChunkMemos | None = None,
) -> LocatedPeak:
    """peak(pp_rank, chunk_counts, chunk_starts) of the plan's sizes (full recompute of every
    layer if asked), memoised; the starts matter only when dense and MoE layers are mixed, and
    then only through which of its layers each chunk holds are MoE (Layers.chunks: what
    rank_peak reads of them), so chunks alike where they start apart are forecast once."""
    layers, plan, chunk_cache = _prepared(model, shape, plan, recompute_all, memos)
    if not layers.mixed:

        @functools.cache
        def alike(rank: int, counts: tuple[int, ...], starts: tuple[int, ...]) -> float:
            return rank_peak(layers, shape, plan, rank, counts, chunk_cache)

        return alike
    by_kinds: dict[tuple, float] = {}

    @functools.cache
    def peak(rank: int, counts: tuple[int, ...], starts: tuple[int, ...]) -> float:
        key = (rank, *layers.chunks(starts, counts))
        if key not in by_kinds:
            by_kinds[key] = rank_peak(layers, shape, plan, rank, counts, chunk_cache, starts)
        return by_kinds[key]

    return peak


def rank_peak_fn(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    recompute_all: bool,
    memos: ChunkMemos | None = None,
) -> RankPeak:
    """rank_peak(pp_rank, chunk_counts) for the partitioner of identical layers (full recompute
    of every layer if asked; `memos`: chunk costs shared with other plans, forecast.chunkmemo)."""
    peak = located_peak_fn(model, shape, plan, recompute_all, memos)
    return lambda rank, counts: peak(rank, counts, ())


def split_score_fn(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    recompute_all: bool,
    memos: ChunkMemos | None = None,
) -> Score:
    """score(layers_per_stage) -> the split's Partition at the plan's sizes (as rank_peak_fn)."""
    peak = located_peak_fn(model, shape, plan, recompute_all, memos)
    return lambda split: evaluate_located(split, plan.pp, plan.vpp, peak)


def rank_table_fn(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    recompute_all: bool,
    memos: ChunkMemos | None = None,
) -> RankTable:
    """table(pp_rank, limit): rank_peak_fn's values for every chunk count up to `limit`, in bulk
    (capture_megatron.forecast.table)."""
    layers, plan, chunk_cache = _prepared(model, shape, plan, recompute_all, memos)

    def table(rank: int, limit: int) -> np.ndarray:
        return peak_table(layers, shape, plan, rank, limit, chunk_cache)

    return table


def rank_rows_fn(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    recompute_all: bool,
    memos: ChunkMemos | None = None,
) -> RankRows:
    """rows(pp_rank, splits): rank_peak_fn's values for each row of chunk counts, in bulk, to
    within rounding (capture_megatron.forecast.rows; None for a rank they do not cover)."""
    layers, plan, chunk_cache = _prepared(model, shape, plan, recompute_all, memos)

    def rows(rank: int, splits: np.ndarray) -> np.ndarray | None:
        return peak_rows(layers, shape, plan, rank, splits, chunk_cache)

    return rows


def _split(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    full: bool,
    unit: int,
    memos: ChunkMemos | None = None,
) -> tuple[int, ...]:
    """The min-max split of the plan's layers: exact for identical layers (any VPP) and for dense
    and MoE layers mixed with one chunk per rank; mixed with interleaving, the better of two local
    searches (contiguous.descend), from the exact split of layers all weighing what an MoE layer
    weighs and from the even split (not proven optimal). `memos`: chunk costs shared with the
    search's other plans (forecast.chunkmemo)."""
    mixed, memos = mixed_layers(shape), {} if memos is None else memos
    if mixed and plan.vpp == 1:
        peak = located_peak_fn(model, shape, plan, full, memos)

        def range_peak(rank: int, start: int, k: int) -> float:
            return peak(rank, (k,), (start,))

        return contiguous_partition(shape.num_layers, plan.pp, range_peak, unit).layers_per_stage
    if mixed:  # from the split of layers all weighing an MoE layer's, and from the even split
        heavy = replace(shape, moe=replace(shape.moe, moe_layer_freq="1"))
        located = located_peak_fn(model, shape, plan, full, memos)
        stages, n = plan.pp * plan.vpp, shape.num_layers // unit
        even = tuple(unit * (n // stages + (i >= stages - n % stages)) for i in range(stages))
        starts = (_split(model, heavy, plan, full, unit, memos), even)
        found = [descend(s, plan.pp, plan.vpp, located, unit) for s in starts]
        return min(found, key=lambda p: p.peak).layers_per_stage
    return min_max_partition(  # chunk costs shared by the peaks one by one, tables and rows
        shape.num_layers,
        plan.pp,
        plan.vpp,
        rank_peak_fn(model, shape, plan, full, memos),
        unit,
        rank_table_fn(model, shape, plan, full, memos),
        rank_rows_fn(model, shape, plan, full, memos),
    ).layers_per_stage


def mtp_last_layer(shape: ModelShape, split: tuple[int, ...], unit: int) -> tuple[int, ...]:
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
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    keep_recompute: bool = False,
    even: bool = False,
    memos: ChunkMemos | None = None,
) -> ParallelPlan:
    """The plan with its layers re-split by the min-max partition (_split; `even`: the candidate's
    even split kept; full recompute: every layer of each chunk recomputed, block method, for the
    trimming that follows; unless `keep_recompute`: the plan's own recompute is kept as given;
    `memos`: chunk costs shared with the search's other plans)."""
    full = plan.recompute.granularity == "full" and not keep_recompute
    rc = plan.recompute
    uniform = keep_recompute and rc.granularity == "full" and rc.method == "uniform"
    unit = max(rc.num_layers) if uniform else 1
    if not even:
        split = _split(model, shape, plan, full, max(unit, 1), memos)
        plan = replace(plan, layers_per_stage=mtp_last_layer(shape, split, max(unit, 1)))
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
    memos: ChunkMemos | None = None,
) -> ParallelPlan:
    """Lower each stage's full-recompute count to the fewest layers that keep it under `cap` (at
    least `floor`: 1 keeps full recompute that was given, 0 may drop it; `memos`: chunk costs
    shared with the search's other plans)."""
    if plan.recompute.granularity != "full":
        return plan
    layers = layers_for(model, shape, plan)
    cache = chunk_memo({} if memos is None else memos, layers, plan)  # the counts' trials share it
    counts = list(plan.recompute.num_layers)
    for r in range(plan.pp):
        while counts[r] > min(floor, max(plan.chunks_of(r))):
            trial = replace(
                plan,
                recompute=Recompute(
                    "full", "block", tuple(counts[:r] + [counts[r] - 1] + counts[r + 1 :])
                ),
            )
            if (
                margins.plan_needed(rank_peak(layers, shape, trial, r, None, cache), shape, trial)
                > cap
            ):
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
    layers, cache = layers_for(model, shape, plan), dict[tuple, object]()  # chunk costs, shared
    stages = tuple(rank_memory(layers, shape, plan, r, cache=cache) for r in range(plan.pp))
    peak = max(s.peak for s in stages)
    needed = margins.plan_needed(peak, shape, plan)
    host = host_per_node(stages, cluster)
    return Evaluated(
        plan,
        stages,
        peak,
        needed,
        needed <= cluster.gpu_memory_bytes and host <= hw.hardware.host_memory_bytes,
        step_seconds(shape, plan, hw),
        host_per_node=host,
    )


def host_overflow(e: Evaluated, cluster: Cluster, host: int) -> str:
    """What the no-fit error says of a plan whose offloaded optimizer overflows a node's `host`
    bytes of host memory ('' when it fits there)."""
    if e.host_per_node <= host:
        return ""
    return (
        f", with --optimizer-cpu-offload of {e.plan.ddp.optimizer_offload_fraction:g} of its "
        f"optimizer, whose host copies take {e.host_per_node / GIB:.1f} GiB on a node's "
        f"{min(cluster.gpus_per_node, cluster.gpus)} ranks, above its {host / GIB:g} GiB of host "
        "memory (--host-memory-gib)"
    )


def host_per_node(stages: tuple[StageMemory, ...], cluster: Cluster) -> float:
    """Host bytes of one node's ranks: the GPUs of a node (at most the cluster's) times the largest
    rank's host bytes (--optimizer-cpu-offload and fine-grained activation offloading; 0 without
    them, and on CPU processes, whose device memory is the host's)."""
    if cluster.device == "cpu":
        return 0.0
    most = max((s.host_total for s in stages), default=0.0)
    return min(cluster.gpus_per_node, cluster.gpus) * most


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
