"""Partitions other systems would choose, predicted side by side with the plan's.

- memory-balanced: CAPTURE's min-max memory split (the min-peak objective's; beside a plan split
  for time it shows what the memory-balanced layout would cost).
- uniform: Megatron's default even split (rejected by Megatron when the layers do not divide).
- megatron-first-last: the best (lowest predicted peak) --decoder-first/last-pipeline-num-layers
  choice under Megatron's rule that the remaining layers split evenly over the middle stages.
- deepspeed-parameters: DeepSpeed PipelineModule(partition_method='parameters') as in DeepSpeed
  0.14-0.16 (deepspeed/runtime/pipe/module.py _partition_layers -> ds_utils.partition_balanced):
  the embedding, the transformer layers and the head are weighted by their parameter counts and
  split into contiguous parts minimising the largest part (bisection on the bottleneck, parts filled
  left to right); the transformer layers of each part form its stage.
Each split is then predicted at the plan's own sizes and recompute (`baseline_recompute`): the
plan's recompute flag for flag when it is not full recompute or was given; when the planner chose
the full-recompute counts, the same rule on the baseline's own stages -- every layer recomputed
when the plan recomputes every layer it holds (min-peak), else the fewest layers that fit the same
memory, as the plan's counts were trimmed (throughput). Pure Python.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from capture_megatron.config import Cluster, ModelShape, ParallelPlan, Recompute
from capture_megatron.config.layout import first_last_split
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel
from capture_megatron.forecast import layers_for, sizes_for
from capture_megatron.planner.balance import (
    balanced,
    evaluate_plan,
    split_score_fn,
    trim_recompute,
)
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.partition import Partition, Score
from capture_megatron.steptime.model import CostModel

BASES = {
    "same": "the plan's recompute",
    "every-layer": "every layer recomputed, as the plan",
    "fewest-that-fit": "the fewest recomputed layers that fit, as the plan's",
}
"""How a baseline's recompute follows the plan's (Baseline.basis), in words."""


@dataclass(frozen=True)
class Baseline:
    """A baseline split, or why the method cannot produce one."""

    name: str
    """memory-balanced, uniform, megatron-first-last or deepspeed-parameters."""
    partition: Partition | None
    """The split and its predicted peaks (None when unavailable)."""
    flags: tuple[str, ...] = ()
    """The Megatron flags that select it (first/last), if any."""
    reason: str = ""
    """Why there is no split."""
    recompute: Recompute = Recompute()
    """The recompute setting the split is predicted at (see basis)."""
    basis: str = "same"
    """How that follows the plan's recompute: a key of BASES."""
    needed: float = 0.0
    """Memory its worst rank needs with the allocator/context margin (bytes)."""
    fits: bool = False
    """needed <= the cluster's memory per GPU."""
    step_seconds: float = 0.0
    """Estimated step time (the cost model's)."""


def uniform(num_layers: int, pp: int, vpp: int, score: Score) -> Baseline:
    """Megatron's even split."""
    stages = pp * vpp
    if num_layers % stages:
        return Baseline(
            "uniform", None, reason=f"{num_layers} layers do not split evenly over {stages} stages"
        )
    return Baseline("uniform", score((num_layers // stages,) * stages))


def memory_balanced(
    model: MemoryModel, shape: ModelShape, plan: ParallelPlan, given: bool, score: Score
) -> Baseline:
    """CAPTURE's split: the one minimising the worst rank's peak (the min-peak objective's; the
    plan's recompute kept when given, else every layer recomputed, to be trimmed)."""
    return Baseline("memory-balanced", score(balanced(model, shape, plan, given).layers_per_stage))


def megatron_first_last(num_layers: int, pp: int, vpp: int, score: Score) -> Baseline:
    """The best choice of --decoder-first/last-pipeline-num-layers."""
    if pp < 2:
        return Baseline("megatron-first-last", None, reason="needs PP > 1")
    best = None
    given = (None, *range(1, num_layers + 1))  # Megatron refuses 0 (a stage of no layers)
    for first, last in itertools.product(given, given):
        if first is None and last is None:
            continue  # that is the uniform split
        try:
            split = first_last_split(num_layers, pp, vpp, first, last)
        except CaptureError:
            continue
        if min(split) == 0:
            continue  # an empty stage: Megatron refuses 0 for the ends; no middle stage either
        part = score(split)
        if best is None or part.peak < best[0].peak:
            best = (part, first, last)
    if best is None:
        return Baseline(
            "megatron-first-last", None, reason="no first/last choice satisfies Megatron's rules"
        )
    part, first, last = best
    flags: tuple[str, ...] = ()
    if first is not None:
        flags += ("--decoder-first-pipeline-num-layers", str(first))
    if last is not None:
        flags += ("--decoder-last-pipeline-num-layers", str(last))
    return Baseline("megatron-first-last", part, flags=flags)


def _fill(weights: list[int], parts: int, limit: int) -> list[int] | None:
    """Left-to-right fill under `limit`; part boundaries or None when more parts are needed."""
    bounds, total, used = [0], 0, 1
    for i, w in enumerate(weights):
        if w > limit:
            return None
        if total + w > limit:
            used += 1
            if used > parts:
                return None
            bounds.append(i)
            total = 0
        total += w
    bounds += [len(weights)] * (parts + 1 - len(bounds))
    return bounds


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's partition_balanced: boundaries of contiguous parts minimising the largest sum."""
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fill(weights, parts, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = _fill(weights, parts, lo)
    assert bounds is not None  # lo is feasible: the bisection ends on a limit that fits
    return bounds


def deepspeed_parameters(
    num_layers: int,
    pp: int,
    vpp: int,
    embedding_params: int,
    layer_params: list[int],
    head_params: int,
    score: Score,
) -> Baseline:
    """DeepSpeed's parameter-balanced split (no interleaving in DeepSpeed); `layer_params`: each
    transformer layer's parameters, in order."""
    if vpp > 1:
        return Baseline(
            "deepspeed-parameters", None, reason="DeepSpeed has no interleaved schedule"
        )
    weights = [embedding_params] + list(layer_params) + [head_params]
    bounds = partition_balanced(weights, pp)
    split = tuple(
        sum(1 for i in range(bounds[s], bounds[s + 1]) if 0 < i <= num_layers) for s in range(pp)
    )
    return Baseline("deepspeed-parameters", score(split))


def baselines_for(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    cluster: Cluster | None = None,
    margins: Margins | None = None,
    hw: CostModel = CostModel(),
    given: bool = False,
    floor: int = 0,
) -> tuple[Baseline, ...]:
    """Uniform, the best Megatron first/last choice and DeepSpeed's 'parameters' split at the
    plan's own sizes and recompute (`given`: the plan's recompute was given and is kept flag for
    flag; `cluster`: the memory trimmed counts must fit, None: no trimming; `floor`: the fewest
    layers a trimmed stage keeps recomputing, as the search's trim_recompute)."""
    full_choice = plan.recompute.granularity == "full" and not given
    score = split_score_fn(model, shape, plan, full_choice)
    layers, z = layers_for(model, shape, plan), sizes_for(shape, plan)
    sc = layers.main.constants(z)
    emb, head = sum(sc.chunk("first").end_numels), sum(sc.chunk("last").end_numels)
    n, pp, vpp = shape.num_layers, plan.pp, plan.vpp
    per_layer = [sum(layers.model(m).constants(z).layer_numels) for m in layers.chunk(0, n)]
    splits = (
        memory_balanced(model, shape, plan, given, score),
        uniform(n, pp, vpp, score),
        megatron_first_last(n, pp, vpp, score),
        deepspeed_parameters(n, pp, vpp, emb, per_layer, head, score),
    )
    cluster = cluster or Cluster(gpus=plan.world_size, gpu_memory_bytes=0)
    margins = margins or Margins()
    setting = (given, floor)
    return tuple(_predicted(b, model, shape, plan, cluster, margins, hw, setting) for b in splits)


def baseline_recompute(
    plan: ParallelPlan, layers_per_stage: tuple[int, ...], given: bool
) -> tuple[Recompute, str]:
    """(recompute, basis) of a baseline split of the plan's sizes: the plan's own recompute when
    it is not full or was given; else every layer of the split's stages, to be trimmed to the
    fewest that fit ("fewest-that-fit") unless the plan recomputes every layer it holds."""
    rc = plan.recompute
    if rc.granularity != "full" or given:
        return rc, "same"
    split = replace(plan, layers_per_stage=layers_per_stage)
    every = tuple(max(split.chunks_of(r)) for r in range(plan.pp))
    all_held = all(n >= max(plan.chunks_of(r)) for r, n in enumerate(rc.num_layers))
    return Recompute("full", "block", every), "every-layer" if all_held else "fewest-that-fit"


def _predicted(
    b: Baseline,
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    cluster: Cluster,
    margins: Margins,
    hw: CostModel,
    setting: tuple[bool, int],
) -> Baseline:
    """The baseline split predicted at the plan's sizes and recompute (baseline_recompute;
    `setting`: (given, floor) as baselines_for's)."""
    if b.partition is None:
        return b
    layers = b.partition.layers_per_stage
    rc, basis = baseline_recompute(plan, layers, setting[0])
    split = replace(plan, layers_per_stage=layers, recompute=rc)
    if basis == "fewest-that-fit" and cluster.gpu_memory_bytes:
        cap = cluster.gpu_memory_bytes
        split = trim_recompute(model, shape, split, cap, margins, setting[1])
    e = evaluate_plan(model, shape, split, cluster, margins, hw)
    part = Partition(layers, e.peak, tuple(s.peak for s in e.stages))
    return replace(
        b,
        partition=part,
        recompute=split.recompute,
        basis=basis,
        needed=e.needed,
        fits=e.fits,
        step_seconds=e.step_seconds,
    )
