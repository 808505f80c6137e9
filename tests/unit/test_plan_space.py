"""Issue 28, items 1, 3 and 4: the whole search space, the output explaining the trade, no plan
below its own baselines, and a global batch that does not follow the GPU count. Synthetic memory
model (the planner's logic, no profiling)."""

from __future__ import annotations

import dataclasses

import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import GIB, Cluster, ParallelFlags
from capture_megatron.planner import PlanOptions, Space, plan, space_from
from capture_megatron.planner.baselines import megatron_first_last
from capture_megatron.planner.partition import Partition
from capture_megatron.planner.run import DEFAULT_GLOBAL_BATCH
from capture_megatron.planner.space import CP_FROM, candidates

LONG = dataclasses.replace(SMALL, seq_length=CP_FROM, max_position_embeddings=CP_FROM)
"""SMALL at a sequence long enough for context parallelism to be searched."""


def test_space_covers_vpp_micro_batch_and_cp():
    gpu = Cluster(gpus=8, gpu_memory_bytes=80 * GIB)
    plans = list(candidates(LONG, gpu, 256, Space()))
    at_pp2 = {p.vpp for p in plans if p.pp == 2}
    assert at_pp2 == set(range(1, SMALL.num_layers // 2 + 1))  # every count the layers allow
    assert {p.micro_batch_size for p in plans if p.dp == 1} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {p.cp for p in plans} == {1, 2, 4, 8}
    short = list(candidates(SMALL, gpu, 256, Space()))
    assert {p.cp for p in short} == {1}  # shorter sequences: CP only when given
    cpu = dataclasses.replace(gpu, device="cpu")
    assert {p.cp for p in candidates(LONG, cpu, 256, Space())} == {1}
    given = space_from(ParallelFlags(context_parallel_size=2))
    assert {p.cp for p in candidates(SMALL, gpu, 256, given)} == {2}


def test_global_batch_does_not_follow_the_gpus_and_is_said():
    for gpus in (4, 8):
        cluster = Cluster(gpus=gpus, gpu_memory_bytes=20 * GIB)
        result = plan(SMALL, cluster, PlanOptions(context_gib=0), synthetic_source)
        assert result.best.plan.global_batch_size == DEFAULT_GLOBAL_BATCH
        said = [line for line in result.reasoning if line.startswith("global batch")]
        assert said and str(DEFAULT_GLOBAL_BATCH) in said[0] and "--global-batch-size" in said[0]
    given = PlanOptions(context_gib=0, global_batch_size=64)
    result = plan(SMALL, cluster, given, synthetic_source)
    assert not [line for line in result.reasoning if line.startswith("global batch")]


@pytest.mark.parametrize("memory_gib", [3.0, 4.0, 20.0])
def test_no_fitting_baseline_is_faster_and_the_trade_is_said(memory_gib):
    flags = ParallelFlags(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    options = PlanOptions(space=space_from(flags), global_batch_size=32, context_gib=0)
    cluster = Cluster(gpus=8, gpu_memory_bytes=int(memory_gib * GIB))
    result = plan(SMALL, cluster, options, synthetic_source)
    best = result.best
    assert best.fits and 0 < best.bound <= best.step_seconds
    for b in result.baselines:
        if b.partition is not None and b.fits:
            assert best.step_seconds <= b.step_seconds * (1 + 1e-9), b.name
    names = {line.split(" split")[0] for line in result.reasoning if " split" in line}
    assert {"memory-balanced", "uniform"} <= names


def test_the_trade_line_prices_the_memory_balanced_split():
    """Issue 28, item 3, with memory to spare: the memory-balanced split of the same sizes is
    lower in peak and slower; the line gives both by the numbers of the baseline and the plan,
    and says the lower peak is not needed (the plan's headroom under the cap)."""
    flags = ParallelFlags(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    options = PlanOptions(space=space_from(flags), global_batch_size=32, context_gib=0)
    cluster = Cluster(gpus=8, gpu_memory_bytes=20 * GIB)
    result = plan(SMALL, cluster, options, synthetic_source)
    best, memory = result.best, result.baseline("memory-balanced")
    assert memory.partition is not None and memory.fits
    assert memory.partition.peak < best.peak and memory.step_seconds > best.step_seconds
    line = next(x for x in result.reasoning if x.startswith("memory-balanced split ("))
    lower = f"{round((best.peak - memory.partition.peak) / GIB, 1):g} GiB lower peak"
    slower = f"{100 * (memory.step_seconds / best.step_seconds - 1):.0f}% slower"
    spare = round((cluster.gpu_memory_bytes - best.needed) / GIB, 1)
    headroom = f"not needed: {spare:g} GiB headroom"
    assert lower in line and slower in line and headroom in line, line


def test_the_trade_line_says_which_split_is_faster():
    """A baseline faster than the plan (one that does not fit) is said to be faster, not slower."""
    from capture_megatron.planner.explain import Context, trade

    flags = ParallelFlags(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    options = PlanOptions(space=space_from(flags), global_batch_size=32, context_gib=0)
    cluster = Cluster(gpus=8, gpu_memory_bytes=20 * GIB)
    result = plan(SMALL, cluster, options, synthetic_source)
    best, memory = result.best, result.baseline("memory-balanced")
    ctx = Context(None, SMALL, cluster, options.space, result.margins, None, "throughput")  # type: ignore[arg-type]
    for scale, word in ((0.9, "10% faster"), (1.1, "10% slower"), (1.0, "as fast")):
        quicker = dataclasses.replace(memory, step_seconds=best.step_seconds * scale)
        (line,) = trade(ctx, best, (quicker,))
        assert word in line and ("faster" in line) + ("slower" in line) <= 1, line


def test_min_gpus_recomputes_only_what_the_fewest_gpus_need():
    """The issue's case: min-gpus recomputed every layer (the min-peak plan that proved the GPU
    count) where the fastest plan on those GPUs needs less."""
    options = PlanOptions(objective="min-gpus", global_batch_size=32, context_gib=0)
    cluster = Cluster(gpus=8, gpu_memory_bytes=int(4 * GIB))
    found = plan(SMALL, cluster, options, synthetic_source).best
    rc = found.plan.recompute
    every = rc.granularity == "full" and all(
        n >= max(found.plan.chunks_of(r)) for r, n in enumerate(rc.num_layers)
    )
    assert not every
    fewer = dataclasses.replace(cluster, gpus=found.plan.world_size)
    fastest = plan(
        SMALL, fewer, dataclasses.replace(options, objective="throughput"), synthetic_source
    )
    assert found.step_seconds == pytest.approx(fastest.best.step_seconds)


def test_first_last_baseline_never_has_an_empty_end_stage():
    """Megatron refuses --decoder-first/last-pipeline-num-layers 0 (TransformerConfig: 'must be
    larger than 0'), so the baseline never proposes it, even where it would be lightest."""

    def score(split):
        peak = float(split[0] * 10 + sum(split))  # the first stage is the heavy one
        return Partition(split, peak, (peak,))

    found = megatron_first_last(12, 4, 1, score)
    assert found.partition is not None
    assert min(found.partition.layers_per_stage[0], found.partition.layers_per_stage[-1]) > 0
    values = found.flags[1::2]
    assert all(int(v) > 0 for v in values)


def test_a_given_expert_tp_is_kept_in_every_candidate():
    """--expert-tensor-parallel-size as given (Megatron-Bridge's and the Model Zoo's ETP 1 at TP
    2): every candidate keeps it, and EP sizes divide a stage's ranks over it."""
    from capture_megatron.features.moe import Experts

    moe = dataclasses.replace(
        SMALL, moe=Experts(num_experts=8, moe_token_dispatcher_type="alltoall"), num_layers=4
    )
    flags = ParallelFlags(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
    space = space_from(flags)
    assert space.etp == 1
    plans = list(candidates(moe, Cluster(gpus=8, gpu_memory_bytes=80 * GIB), 64, space))
    assert plans and all(p.tp == 2 and p.expert_tp == 1 for p in plans)
    assert max(p.ep for p in plans) == 8  # 8 ranks of a stage over expert TP 1
    same = list(
        candidates(
            moe,
            Cluster(gpus=8, gpu_memory_bytes=80 * GIB),
            64,
            space_from(ParallelFlags(tensor_model_parallel_size=2)),
        )
    )
    assert all(p.etp == 0 and p.expert_tp == 2 for p in same) and max(p.ep for p in same) == 4
