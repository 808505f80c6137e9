"""Issue 28, item 2: the time-aware partition. On a synthetic memory model (no profiling) small
enough that every contiguous split can be tried, the answer is known: the fastest estimated step
among all splits (each stage recomputing the fewest layers that fit) whose every rank fits the
cap. timed_split must find it (up to two chunks per rank every split is searched), its bound must
not exceed it, and with memory to spare it must be faster than the min-max memory split (the
min-peak objective's) while fitting."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import GIB, Cluster, DdpOptions, ParallelPlan, Recompute
from capture_megatron.forecast import layers_for, rank_memory
from capture_megatron.forecast.ranks import rank_peak
from capture_megatron.planner.balance import balanced, evaluate_plan
from capture_megatron.planner.fastest import fastest, fit_plan
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.ranktimes import RankTimes, least_step, memory_floor
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.supply import Supply, needs_of
from capture_megatron.planner.timed import Beaten, TimedSplit, _hold, _Ranks, timed_split
from capture_megatron.steptime.constants import fitted
from capture_megatron.steptime.model import CostModel, step_seconds
from capture_megatron.steptime.settings import StepSettings

HW = CostModel()
MARGINS = Margins(context_bytes=0.0)


def _plan(pp: int, vpp: int, recompute: str, mbs: int = 1) -> ParallelPlan:
    stages = pp * vpp
    even = tuple(SMALL.num_layers // stages for _ in range(stages))
    rc = Recompute("full", "block", (0,) * pp) if recompute == "full" else Recompute(recompute)
    return ParallelPlan(
        tp=2, pp=pp, dp=8 // (2 * pp), micro_batch_size=mbs, global_batch_size=32, vpp=vpp,
        layers_per_stage=even, recompute=rc, sequence_parallel=True, distributed_optimizer=True,
    )  # fmt: skip


def _model(plan: ParallelPlan):
    return synthetic_source(needs_of(SMALL, [plan, replace(plan, recompute=Recompute())]))


def _splits(n: int, stages: int):
    for cut in itertools.combinations(range(n + stages - 1), stages - 1):
        bounds = (-1, *cut, n + stages - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(stages))


def _known_fastest(plan: ParallelPlan, cap: float) -> tuple[float, float]:
    """(step, peak) of the fastest split that fits, by trying every split; with full recompute
    each rank's count is the fewest that fits (a rank's memory depends on its own count only)."""
    model = _model(plan)
    layers = layers_for(model, SMALL, plan)
    best = (float("inf"), float("inf"))
    for split in _splits(SMALL.num_layers, plan.pp * plan.vpp):
        trial = replace(plan, layers_per_stage=split)
        counts, peaks = [], []
        for r in range(plan.pp):
            options = (
                range(max(trial.chunks_of(r)) + 1) if plan.recompute.granularity == "full" else [0]
            )
            for n in options:
                probe = trial
                if plan.recompute.granularity == "full":
                    c = tuple(n if q == r else 0 for q in range(plan.pp))
                    probe = replace(trial, recompute=Recompute("full", "block", c))
                peak = rank_memory(layers, SMALL, probe, r).peak
                if MARGINS.needed(peak) <= cap:
                    counts.append(n)
                    peaks.append(peak)
                    break
        if len(counts) < plan.pp:
            continue
        if plan.recompute.granularity == "full":
            trial = replace(trial, recompute=Recompute("full", "block", tuple(counts)))
        best = min(best, (step_seconds(SMALL, trial, HW), max(peaks)))
    return best


CASES = [
    (4, 1, "none", 20.0),
    pytest.param(4, 1, "full", 3.0, marks=pytest.mark.slow),  # 15-40 s each: the full suite's
    (2, 2, "none", 20.0),
    pytest.param(2, 2, "full", 3.4, marks=pytest.mark.slow),
    (2, 1, "selective", 5.0),
]


@pytest.mark.parametrize("pp,vpp,recompute,cap_gib", CASES)
def test_timed_split_is_the_fastest_split_that_fits(pp, vpp, recompute, cap_gib):
    plan, cap = _plan(pp, vpp, recompute), cap_gib * GIB
    known_step, known_peak = _known_fastest(plan, cap)
    assert known_step < float("inf"), "the case must have a split that fits"
    found = timed_split(_model(plan), SMALL, plan, cap, MARGINS, HW, recompute == "full")
    assert found is not None
    e = evaluate_plan(_model(plan), SMALL, found.plan, Cluster(gpus=8, gpu_memory_bytes=int(cap)),
                      MARGINS, HW)  # fmt: skip
    assert e.fits
    assert found.seconds == pytest.approx(e.step_seconds, rel=1e-12)
    assert found.seconds == pytest.approx(known_step, rel=1e-9), (found.plan, known_step)
    assert found.bound <= known_step * (1 + 1e-12)
    assert least_step(SMALL, plan, HW) <= found.bound * (1 + 1e-12)


def test_no_split_fits_gives_none():
    plan = _plan(4, 1, "full")
    assert timed_split(_model(plan), SMALL, plan, 0.5 * GIB, MARGINS, HW, True) is None


def test_the_excess_is_taken_from_ranks_that_hold_layers():
    """An end alone (the embedding of a large vocabulary) may weigh more than a rank's layers:
    the layers above n are still taken from ranks holding some, never below 0 (seen: Qwen3-30B-A3B
    on 16 GPUs reached a rank of -2 layers)."""
    from capture_megatron.planner.timed import _spread

    assert _spread([0, 2, 2], 3, [5.0, 0.0, 0.0], 1.0) == [0, 1, 2]


def test_time_layout_beats_the_memory_layout_with_memory_to_spare():
    """The min-max memory split piles layers where memory is low (the last rank's fewer
    micro-batches in flight), which a time-aware split need not do when memory is ample; the
    output layer on the last rank makes the even split uneven in time, too."""
    plan = _plan(4, 2, "none")
    model, cap = _model(plan), 20 * GIB
    cluster = Cluster(gpus=8, gpu_memory_bytes=int(cap))
    found = timed_split(model, SMALL, plan, cap, MARGINS, HW, False)
    assert found is not None
    memory = evaluate_plan(model, SMALL, balanced(model, SMALL, plan), cluster, MARGINS, HW)
    timed = evaluate_plan(model, SMALL, found.plan, cluster, MARGINS, HW)
    assert timed.fits and memory.fits
    assert timed.step_seconds < memory.step_seconds
    assert memory.peak <= timed.peak


@pytest.mark.parametrize("pp,mbs", [(1, 1), (2, 2), (4, 1), (4, 4)])
def test_memory_floor_is_below_every_split(pp, mbs):
    """The search drops sizes whose memory_floor (parameters, gradients, a share of the optimizer
    state, every layer's input per micro-batch in flight) does not fit without profiling them: it
    must not exceed the peak of any split, even recomputing every layer."""
    plan = _plan(pp, 1, "full", mbs)
    model = _model(plan)
    layers = layers_for(model, SMALL, plan)
    least = float("inf")
    for split in _splits(SMALL.num_layers, pp):
        trial = replace(plan, layers_per_stage=split, recompute=Recompute("full", "block", split))
        least = min(least, max(rank_memory(layers, SMALL, trial, r).peak for r in range(pp)))
    assert 0 < memory_floor(SMALL, plan) <= least


@pytest.mark.parametrize(
    "pp,vpp,ddp",
    [(1, 1, DdpOptions()), (2, 1, DdpOptions()), (4, 2, DdpOptions()),
     (4, 3, DdpOptions(defer_embedding_wgrad_compute=True, wgrad_deferral_limit=2)),
     (2, 2, DdpOptions(use_precision_aware_optimizer=True, exp_avg_dtype="bf16"))],
)  # fmt: skip
def test_rank_peak_is_rank_memorys_peak(pp, vpp, ddp):
    """The split search's rank_peak (the chunk costs memoised, no breakdown) gives, bit for bit,
    the peak rank_memory gives without a memo, for every rank, chunk layers and recomputed
    count, the memo filled along the way."""
    plan = replace(_plan(pp, vpp, "full"), ddp=ddp)
    layers = layers_for(_model(plan), SMALL, plan)
    cache: dict = {}
    for rank, n in itertools.product(range(pp), range(4)):
        counts = tuple(n if r == rank else 0 for r in range(pp))
        trial = replace(plan, recompute=Recompute("full", "block", counts))
        for chunks in itertools.product(range(5), repeat=vpp):
            slow = rank_memory(layers, SMALL, trial, rank, chunks).peak
            assert rank_peak(layers, SMALL, trial, rank, chunks, cache) == slow, (rank, chunks, n)


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (4, 1), (4, 2)])
def test_least_bottleneck_is_the_least_limit_holding_every_layer(pp, vpp):
    """The least slowest-rank time of any split when memory is no bound: the ranks hold all
    layers within it (RankTimes.held), not within any limit below it; and it is some split's
    slowest rank."""
    ranks = RankTimes(SMALL, _plan(pp, vpp, "none"), HW)
    below, at = ranks.least_bottleneck()
    assert below < at
    assert sum(ranks.held(r, at) for r in range(pp)) >= SMALL.num_layers
    assert sum(ranks.held(r, below) for r in range(pp)) < SMALL.num_layers
    slowest = (
        max(ranks.unrecomputed(r, k) for r, k in enumerate(s))
        for s in _splits(SMALL.num_layers, pp)
    )
    assert min(slowest) == at


OVERLAPPED = CostModel(
    settings=StepSettings(overlap_grad_reduce=True, overlap_param_gather=True),
    constants=replace(fitted(), chunk_overhead=1e-9),
)
"""Overlapped DP collectives (their exposure bound matters) and next to no cost per chunk (so
interleaving wins where memory allows it, and the twin bound matters)."""


@pytest.mark.parametrize(
    "tp,pp,gbs,cap_gib",
    [(2, 4, 8, 2.6), (2, 4, 32, 6.0), (2, 2, 8, 3.5), (2, 2, 32, 6.0), (1, 4, 32, 6.0),
     (1, 2, 32, 6.0), (2, (1, 2, 4), 16, 3.2)],
)  # fmt: skip
def test_branch_and_bound_finds_the_fastest_candidate(tp, pp, gbs, cap_gib):
    """The throughput search stops on lower bounds (the DP collectives' exposure behind no more
    than a rank's micro-batch, the twin without interleaving's least bottleneck) and skips
    candidates whose lighter twins do not fit: its fastest plan must be the fastest of every
    candidate split on its own (fit_plan), under caps that force recompute or leave room."""
    pps = pp if isinstance(pp, tuple) else (pp,)
    space = Space(tp=(tp,), pp=pps, vpp=(1, 2, 4), micro_batch_size=(1, 2),
                  recompute=("selective", "full"), cp=(1,))  # fmt: skip
    cluster = Cluster(gpus=8, gpu_memory_bytes=int(cap_gib * GIB))
    plans = list(candidates(SMALL, cluster, gbs, space))
    plain = [replace(p, recompute=Recompute()) for p in plans]  # chosen counts all 0
    model = synthetic_source(needs_of(SMALL, plans + plain))
    found = fastest(Supply(SMALL, model), SMALL, cluster, plans, MARGINS, OVERLAPPED, 1, False)
    every = [
        fit_plan(lambda _: model, SMALL, p, cluster, MARGINS, OVERLAPPED, False).evaluated
        for p in plans
    ]
    fitting = [e.step_seconds for e in every if e.fits]
    assert fitting and found.considered < len(plans)
    assert found.ranked[0].fits and found.ranked[0].step_seconds == pytest.approx(min(fitting))


@pytest.mark.parametrize(
    "pp,vpp,recompute,cap_gib",
    [(4, 1, "none", 20.0), (2, 2, "none", 20.0), (4, 1, "full", 3.0), (2, 2, "full", 3.4)],
)
def test_a_step_to_beat_leaves_only_the_splits_that_cannot(pp, vpp, recompute, cap_gib):
    """A twin search wants only splits faster than a step it knows: timed_split given it leaves a
    plan (Beaten) only where the full search's fastest split is no faster, and otherwise finds the
    same split."""
    plan, cap = _plan(pp, vpp, recompute), cap_gib * GIB
    full = timed_split(_model(plan), SMALL, plan, cap, MARGINS, HW, recompute == "full")
    assert isinstance(full, TimedSplit)
    left = 0
    for beat in (1.01 * full.seconds, full.seconds, 0.99 * full.seconds, 0.9 * full.bound):
        cut = timed_split(_model(plan), SMALL, plan, cap, MARGINS, HW, recompute == "full", 0,
                          None, beat)  # fmt: skip
        if isinstance(cut, Beaten):
            left += 1
            assert full.seconds >= beat
            assert cut.bottleneck <= full.bottleneck
        else:
            assert cut is not None
            if full.seconds < beat:
                assert (cut.plan, cut.seconds) == (full.plan, full.seconds)
    if recompute == "full":  # memory binds: the bottleneck is above the least without memory
        assert left >= 1, "some step to beat leaves the plan"


@pytest.mark.parametrize("pp,vpp,recompute,cap_gib", [(4, 1, "none", 20.0), (4, 1, "full", 3.0)])
def test_hold_answers_as_every_ranks_capacity(pp, vpp, recompute, cap_gib):
    """timed._hold (a twin's cut) says whether the ranks' capacities at a limit hold the layers,
    as all of them asked do, at limits from below the least bottleneck without memory up."""
    plan, choose = _plan(pp, vpp, recompute), recompute == "full"
    if choose:
        plan = replace(plan, recompute=Recompute("full", "block", (0,) * pp))
    ranks = _Ranks(_model(plan), SMALL, plan, cap_gib * GIB, MARGINS, HW, choose)
    least = ranks.least_bottleneck()[1]
    answers = set()
    for scale in (0.9, 1.0, 1.1, 1.3, 1.6, 2.0, 3.0):
        caps = [ranks.capacity(r, least * scale) for r in range(pp)]
        every = min(caps) >= 0 and sum(caps) >= SMALL.num_layers
        assert _hold(ranks, SMALL.num_layers, least * scale) == every, scale
        answers.add(every)
    assert answers == {True, False}
