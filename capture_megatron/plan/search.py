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
from typing import Any

from capture_megatron.config import Cluster, ModelShape, ParallelFlags, ParallelPlan, Recompute
from capture_megatron.config.parallel import tp_fits
from capture_megatron.config.resolve import refuse_context_parallel
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel
from capture_megatron.plan.costmodel import Hardware, step_seconds
from capture_megatron.plan.margins import Margins
from capture_megatron.plan.partition import RankPeak, min_max_partition
from capture_megatron.predict import StageMemory, find_variant, rank_memory, variant_of

OBJECTIVES = ("min-peak", "throughput", "min-gpus")
"""What the search optimises (--objective)."""


@dataclass(frozen=True)
class Space:
    """What the search may choose; a one-element tuple fixes a value (given on the command line)."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    """Tensor-parallel sizes (kept within a node)."""
    pp: tuple[int, ...] = ()
    """Pipeline sizes; empty: every size up to the layer count."""
    vpp: tuple[int, ...] = (1, 2)
    """Virtual stages per pipeline rank."""
    micro_batch_size: tuple[int, ...] = (1, 2)
    """Micro-batch sizes."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    """Recompute granularities."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence parallelism (only with TP > 1)."""
    distributed_optimizer: tuple[bool, ...] = (False, True)
    """Megatron's distributed optimizer (only with DP > 1)."""
    recompute_method: str = ""
    """Full recompute's method as given (block or uniform); empty: block, counts searched."""
    recompute_layers: tuple[int, ...] = ()
    """Full recompute's layer counts as given: one n (--recompute-num-layers) or one per pipeline
    stage; empty: the planner chooses per-stage block counts."""

    @property
    def keeps_recompute(self) -> bool:
        """Whether full recompute's method and counts were given (and are kept as given)."""
        return bool(self.recompute_layers)

    def full_recompute(self, pp: int) -> Recompute:
        """The full-recompute setting of a candidate with `pp` stages."""
        if not self.recompute_layers:
            return Recompute("full", "block", (1,) * pp)
        counts = self.recompute_layers
        return Recompute(
            "full", self.recompute_method or "block", counts if len(counts) == pp else counts * pp
        )


def space_from(flags: ParallelFlags) -> Space:
    """The search space with the values the command line fixed (CaptureError for CP > 1)."""
    refuse_context_parallel(flags.context_parallel_size)
    fixed: dict[str, Any] = {}
    if flags.tensor_model_parallel_size:
        fixed["tp"] = (flags.tensor_model_parallel_size,)
    if flags.pipeline_model_parallel_size:
        fixed["pp"] = (flags.pipeline_model_parallel_size,)
    if flags.num_virtual_stages_per_pipeline_rank:
        fixed["vpp"] = (flags.num_virtual_stages_per_pipeline_rank,)
    if flags.micro_batch_size:
        fixed["micro_batch_size"] = (flags.micro_batch_size,)
    if flags.recompute_granularity or flags.recompute_activations:
        fixed["recompute"] = (flags.recompute_granularity or "selective",)
    if flags.recompute_granularity == "full":
        per_stage = flags.recompute_num_layers_per_stage
        if per_stage:
            fixed["recompute_layers"] = tuple(int(x) for x in per_stage.split(","))
        elif flags.recompute_num_layers is not None:
            fixed["recompute_layers"] = (flags.recompute_num_layers,)
        fixed["recompute_method"] = flags.recompute_method or ""
    if flags.sequence_parallel:
        fixed["sequence_parallel"] = (True,)
    if flags.use_distributed_optimizer:
        fixed["distributed_optimizer"] = (True,)
    return replace(Space(), **fixed)


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


def rank_peak_fn(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, recompute_all: bool
) -> RankPeak:
    """rank_peak(pp_rank, chunk_counts) for the partitioner (full recompute of every layer if
    asked)."""
    vm = find_variant(model, variant_of(shape, plan))
    if recompute_all:  # every layer of every stage recomputed (more than any stage can hold)
        plan = replace(plan, recompute=Recompute("full", "block", (shape.num_layers,) * plan.pp))
    chunk_cache: dict = {}

    @functools.cache
    def peak(rank: int, counts: tuple[int, ...]) -> float:
        return rank_memory(vm, shape, plan, rank, counts, chunk_cache).peak

    return peak


def balanced(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, keep_recompute: bool = False
) -> ParallelPlan:
    """The plan with its layers re-split by the exact min-max partition (full recompute: every
    layer of each chunk recomputed, block method, for the trimming that follows; unless
    `keep_recompute`: the plan's own recompute is kept as given)."""
    full = plan.recompute.granularity == "full" and not keep_recompute
    rc = plan.recompute
    uniform = keep_recompute and rc.granularity == "full" and rc.method == "uniform"
    unit = max(rc.num_layers) if uniform else 1
    part = min_max_partition(
        shape.num_layers, plan.pp, plan.vpp, rank_peak_fn(model, shape, plan, full), max(unit, 1)
    )
    plan = replace(plan, layers_per_stage=part.layers_per_stage)
    if full:
        plan = replace(
            plan,
            recompute=Recompute(
                "full", "block", tuple(max(plan.chunks_of(r)) for r in range(plan.pp))
            ),
        )
    return plan


def trim_recompute(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, cap: float, margins: Margins
) -> ParallelPlan:
    """Lower each stage's full-recompute count to the fewest layers that keep it under `cap`."""
    if plan.recompute.granularity != "full":
        return plan
    vm = find_variant(model, variant_of(shape, plan))
    counts = list(plan.recompute.num_layers)
    for r in range(plan.pp):
        while counts[r] > 0:
            trial = replace(
                plan,
                recompute=Recompute(
                    "full", "block", tuple(counts[:r] + [counts[r] - 1] + counts[r + 1 :])
                ),
            )
            if margins.needed(rank_memory(vm, shape, trial, r).peak) > cap:
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
    hw: Hardware,
) -> Evaluated:
    """Predict a fixed plan."""
    vm = find_variant(model, variant_of(shape, plan))
    stages = tuple(rank_memory(vm, shape, plan, r) for r in range(plan.pp))
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    shape: ModelShape, cluster: Cluster, gbs: int, space: Space
) -> Iterator[ParallelPlan]:
    """Every plan of the space that Megatron can run on exactly cluster.gpus processes."""
    for tp in space.tp:
        if tp > cluster.gpus_per_node or cluster.gpus % tp:
            continue
        for pp in space.pp or tuple(_divisors(cluster.gpus // tp)):
            if cluster.gpus % (tp * pp) or pp > shape.num_layers:
                continue
            dp = cluster.gpus // (tp * pp)
            for vpp in space.vpp:
                if vpp > 1 and (pp == 1 or pp * vpp > shape.num_layers):
                    continue
                yield from _variants(shape, tp, pp, dp, vpp, gbs, space)


def _dominated(on: bool, size: int, allowed: tuple[bool, ...]) -> bool:
    """Sequence parallelism (TP > 1) and the distributed optimizer (DP > 1) move the same bytes as
    their absence (reduce-scatter + all-gather instead of all-reduce) and only lower memory, so when
    the space allows both, the plan without them is dominated and not searched."""
    return not on and size > 1 and True in allowed


def _variants(
    shape: ModelShape, tp: int, pp: int, dp: int, vpp: int, gbs: int, space: Space
) -> Iterator[ParallelPlan]:
    for mbs in space.micro_batch_size:
        if gbs % (mbs * dp):
            continue
        m = gbs // (mbs * dp)
        if vpp > 1 and (m < pp or (m % pp and m % pp < pp)):
            continue
        for sp in space.sequence_parallel:
            if sp and tp == 1:  # Megatron-LM turns sequence parallelism off at TP 1
                if False in space.sequence_parallel:
                    continue
                sp = False
            if not tp_fits(shape, tp, sp) or _dominated(sp, tp, space.sequence_parallel):
                continue
            for rc in space.recompute:
                recompute = space.full_recompute(pp) if rc == "full" else Recompute(rc)
                for do in space.distributed_optimizer:
                    if (do and dp == 1 and len(space.distributed_optimizer) > 1) or _dominated(
                        do, dp, space.distributed_optimizer
                    ):
                        continue
                    stages = pp * vpp
                    layers = tuple(
                        shape.num_layers // stages + (1 if i < shape.num_layers % stages else 0)
                        for i in range(stages)
                    )
                    yield ParallelPlan(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        vpp=vpp,
                        micro_batch_size=mbs,
                        global_batch_size=gbs,
                        layers_per_stage=layers,
                        recompute=recompute,
                        sequence_parallel=sp,
                        distributed_optimizer=do,
                    )


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans of a search."""

    ranked: tuple[Evaluated, ...]
    """Fitting plans first, then by the objective."""
    considered: int
    """Candidates evaluated."""


def search(
    model: MemoryModel,
    shape: ModelShape,
    cluster: Cluster,
    gbs: int,
    space: Space,
    objective: str,
    margins: Margins,
    hw: Hardware = Hardware(),
    top: int = 10,
) -> SearchResult:
    """Balance and predict the candidates; rank by the objective (fitting plans first).

    min-peak skips candidates another candidate dominates in memory (same sizes with a smaller
    micro-batch, without interleaving, or with full recompute, which keeps only each layer's input:
    larger micro-batches, interleaving and keeping more activations only add memory). throughput is
    a branch and bound: candidates in order of a step-time lower bound (step_seconds(bound=True)),
    stopping once `top` fitting plans are at least as fast as every bound left; a candidate is only
    balanced when its lighter twins fit (the same sizes without interleaving, and with full
    recompute trimmed to the fewest layers that fit: they need no more memory)."""
    if objective not in OBJECTIVES:
        raise CaptureError(f"--objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    plans = list(candidates(shape, cluster, gbs, space))
    if objective == "throughput":
        return _fastest(model, shape, cluster, plans, margins, hw, top, space.keeps_recompute)
    plans = [p for p in plans if not _memory_dominated(p, space)]
    keep = space.keeps_recompute
    results = [
        evaluate_plan(model, shape, balanced(model, shape, p, keep), cluster, margins, hw)
        for p in plans
    ]
    ranked = sorted(results, key=lambda e: (not e.fits, e.peak, e.step_seconds))
    return SearchResult(tuple(ranked[:top]), len(results))


def _memory_dominated(plan: ParallelPlan, space: Space) -> bool:
    return (
        (plan.vpp > 1 and 1 in space.vpp)
        or plan.micro_batch_size > min(space.micro_batch_size)
        or (plan.recompute.granularity != "full" and "full" in space.recompute)
    )


def _fastest(
    model: MemoryModel,
    shape: ModelShape,
    cluster: Cluster,
    plans: list[ParallelPlan],
    margins: Margins,
    hw: Hardware,
    top: int,
    keep_recompute: bool,
) -> SearchResult:
    def sizes(p: ParallelPlan, recompute: str) -> tuple:
        return (
            p.tp,
            p.pp,
            p.dp,
            p.micro_batch_size,
            recompute,
            p.sequence_parallel,
            p.distributed_optimizer,
        )

    # the lightest twin: no interleaving and full recompute when the space has them
    flat = {sizes(p, p.recompute.granularity): p for p in plans if p.vpp == 1}
    light = {key: plan for key, plan in flat.items() if key[4] == "full"}
    done: dict[ParallelPlan, Evaluated] = {}

    def run(plan: ParallelPlan) -> Evaluated:
        if plan not in done:
            fitted = balanced(model, shape, plan, keep_recompute)
            if not keep_recompute:
                fitted = trim_recompute(model, shape, fitted, cluster.gpu_memory_bytes, margins)
            done[plan] = evaluate_plan(model, shape, fitted, cluster, margins, hw)
        return done[plan]

    for plan in sorted(plans, key=lambda p: step_seconds(shape, p, hw, bound=True)):
        fitting = sorted(e.step_seconds for e in done.values() if e.fits)
        if len(fitting) >= top and fitting[top - 1] <= step_seconds(shape, plan, hw, bound=True):
            break
        twins = (light.get(sizes(plan, "full")), flat.get(sizes(plan, plan.recompute.granularity)))
        if any(t is not None and t != plan and not run(t).fits for t in twins):
            continue
        run(plan)
    ranked = sorted(done.values(), key=lambda e: (not e.fits, e.step_seconds, e.peak))
    return SearchResult(tuple(ranked[:top]), len(done))
