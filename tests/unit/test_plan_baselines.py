"""Issue 13, item 2: the baselines (uniform, Megatron first/last, DeepSpeed parameters) are
predicted at the plan's own sizes and recompute -- flag for flag when the recompute was given or is
not full; when the planner chose full-recompute counts, by the same rule on the baseline's own
stages (every layer, or the fewest that fit) -- and a comparison is said in words, never as a
negative '% lower'. Synthetic memory model, no profiling."""

from __future__ import annotations

import dataclasses
import re

import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.cli.render import print_plan
from capture_megatron.config import GIB, Cluster, ParallelFlags, Recompute
from capture_megatron.forecast import variant_of
from capture_megatron.planner import PlanOptions, plan, space_from
from capture_megatron.planner.baselines import BASES
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.search import trim_recompute
from capture_megatron.records import ProbeShape

NEGATIVE = re.compile(r"-\d[\d.]*% lower")


def planned(objective: str, memory_gib: float, **given):
    flags = ParallelFlags(pipeline_model_parallel_size=4, tensor_model_parallel_size=2, **given)
    options = PlanOptions(
        objective=objective, space=space_from(flags), global_batch_size=32, context_gib=0
    )
    cluster = Cluster(gpus=8, gpu_memory_bytes=int(memory_gib * GIB))
    return plan(SMALL, cluster, options, synthetic_source)


def check_words(result, capsys) -> str:
    """The baselines in JSON and in print: no negative reduction, no negative '% lower'."""
    for name, entry in result.to_plain()["baselines"].items():
        if "unavailable" in entry:
            continue
        assert entry["reduction_by_plan"] is None or entry["reduction_by_plan"] >= 0, name
        assert not NEGATIVE.search(entry["comparison"]), entry["comparison"]
        assert entry["recompute_basis"] in BASES.values()
    print_plan(result)
    out = capsys.readouterr().out
    assert not NEGATIVE.search(out), out
    return out


def test_trimmed_counts_baselines_get_their_own_fewest_that_fit(capsys):
    result = planned("throughput", 4, recompute_granularity="full")
    best = result.best.plan
    assert len(set(best.recompute.num_layers)) > 1  # the planner's per-stage counts
    compared = [b for b in result.baselines if b.partition is not None]
    assert compared
    for b in compared:
        assert b.basis == "fewest-that-fit" and b.fits, b
        split = dataclasses.replace(best, layers_per_stage=b.partition.layers_per_stage)
        every = tuple(max(split.chunks_of(r)) for r in range(best.pp))
        assert b.recompute.granularity == "full" and b.recompute.num_layers != every
        assert all(n >= 1 for n in b.recompute.num_layers)  # full recompute was given
    out = check_words(result, capsys)
    assert "other systems' splits at the plan's sizes and recompute:" in out


def test_every_layer_plans_compare_with_every_layer_baselines(capsys):
    result = planned("min-peak", 80, recompute_granularity="full")
    best = result.best.plan
    assert all(n >= max(best.chunks_of(r)) for r, n in enumerate(best.recompute.num_layers))
    for b in result.baselines:
        if b.partition is not None:
            assert b.basis == "every-layer"
            split = dataclasses.replace(best, layers_per_stage=b.partition.layers_per_stage)
            for r, n in enumerate(b.recompute.num_layers):
                assert n == max(split.chunks_of(r))
            assert b.partition.peak >= result.best.peak  # the plan is the min-max split
    check_words(result, capsys)


@pytest.mark.parametrize(
    "given",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
        {"recompute_granularity": "selective"},
        {"recompute_granularity": "none"},
    ],
)
def test_given_or_partial_recompute_is_compared_flag_for_flag(given, capsys):
    result = planned("throughput", 80, **given)
    for b in result.baselines:
        if b.partition is not None:
            assert b.basis == "same" and b.recompute == result.best.plan.recompute
    check_words(result, capsys)


def test_comparisons_that_favour_the_baseline_are_said_in_words():
    result = planned("throughput", 4, recompute_granularity="full")
    b = next(b for b in result.baselines if b.partition is not None)
    lower = dataclasses.replace(
        b, partition=dataclasses.replace(b.partition, peak=0.9 * result.best.peak)
    )
    assert result.comparison(lower).startswith("its worst rank is 10.0% below the plan's")
    assert result._baseline_entry(lower)["reduction_by_plan"] is None
    unfit = dataclasses.replace(
        b,
        partition=dataclasses.replace(b.partition, peak=1.2 * result.best.peak),
        fits=False,
        recompute=Recompute("full", "block", (9, 9, 9, 9)),
        step_seconds=2.0,
    )
    words = result.comparison(unfit)
    assert words.startswith("the plan's worst rank is 16.7% lower; it does not fit where the plan")
    assert "estimated step 2.00 s vs the plan's" in words


def test_trim_keeps_the_floor():
    best = planned("min-peak", 80, recompute_granularity="full").best.plan
    probe = ProbeShape.of(SMALL, best.tp, best.micro_batch_size)
    model = synthetic_source(frozenset({(variant_of(SMALL, best), probe)}))
    margins = Margins(context_bytes=0)
    trimmed = trim_recompute(model, SMALL, best, 80 * GIB, margins, floor=1)
    assert trimmed.recompute.num_layers == (1,) * best.pp
    assert trim_recompute(model, SMALL, best, 80 * GIB, margins).recompute == Recompute()
