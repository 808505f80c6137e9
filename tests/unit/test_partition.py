"""The partitioner is exact: brute force over every split on hundreds of random instances."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import DdpOptions, ParallelPlan, Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.forecast import layers_for, rank_peak
from capture_megatron.forecast.rows import peak_rows
from capture_megatron.planner.balance import rank_peak_fn, rank_rows_fn
from capture_megatron.planner.contiguous import _moved
from capture_megatron.planner.partition import (
    _Ranks,
    _splits,
    evaluate,
    evaluate_located,
    min_max_partition,
)
from capture_megatron.planner.supply import needs_of


def _random_cost(rng: random.Random, pp: int, vpp: int):
    """A predictor-like cost: per-rank static + per-layer static + in-flight x activations, with
    stage-dependent ends and an occasional step (like allocator padding)."""
    base = [rng.uniform(0, 50) for _ in range(pp)]
    per_layer = rng.uniform(1, 5)
    act = rng.uniform(1, 20)
    inflight = [[rng.randint(1, 2 * pp) for _ in range(vpp)] for _ in range(pp)]
    bump = rng.uniform(0, 10)

    def cost(rank: int, counts: tuple[int, ...]) -> float:
        total = sum(counts)
        acts = sum(n * act * inflight[rank][v] for v, n in enumerate(counts))
        return base[rank] + per_layer * total + acts + (bump if total >= 3 else 0.0)

    return cost


def _brute(n: int, pp: int, vpp: int, cost) -> float:
    best = float("inf")
    for cut in itertools.combinations(range(n + pp * vpp - 1), pp * vpp - 1):
        bounds = (-1,) + cut + (n + pp * vpp - 1,)
        split = tuple(bounds[i + 1] - bounds[i] - 1 for i in range(pp * vpp))
        best = min(best, evaluate(split, pp, vpp, cost).peak)
    return best


@pytest.mark.parametrize("vpp", [1, 2, 3])
def test_matches_brute_force(vpp):
    rng = random.Random(vpp)
    for _ in range(120 if vpp == 1 else 60):
        pp = rng.randint(2 if vpp > 1 else 1, 4 if vpp == 1 else 3)
        n = rng.randint(1, 9 if vpp == 1 else 6)
        cost = _random_cost(rng, pp, vpp)
        got = min_max_partition(n, pp, vpp, cost)
        assert sum(got.layers_per_stage) == n and len(got.layers_per_stage) == pp * vpp
        assert got.peak == pytest.approx(_brute(n, pp, vpp, cost), rel=1e-9)
        assert got.peak == pytest.approx(evaluate(got.layers_per_stage, pp, vpp, cost).peak)


def test_ties_go_to_balanced_compute():
    flat = lambda rank, counts: 0.0  # every split ties  # noqa: E731
    assert min_max_partition(10, 4, 1, flat).layers_per_stage == (2, 2, 3, 3)
    assert max(min_max_partition(12, 3, 2, flat).layers_per_stage) == 2


def test_stage_without_layers_when_it_lowers_the_peak():
    # rank 0's ends alone cost 100; any layer there costs 1000 more
    cost = lambda rank, c: (100 + 1000 * sum(c)) if rank == 0 else 10 * sum(c)  # noqa: E731
    assert min_max_partition(8, 4, 1, cost).layers_per_stage[0] == 0


def test_thousand_layers_over_64_stages_is_optimal():
    """Checked against every achievable cap: the optimum is the smallest rank cost C at which the
    ranks hold all layers (each the most layers whose cost stays <= C). Timing: bench/speed.py."""

    def cost(rank, c):
        return (64 - rank) * 3.0 * c[0] + 5.0 * c[0] + (200 if rank == 0 else 0)

    part = min_max_partition(1000, 64, 1, cost)
    assert sum(part.layers_per_stage) == 1000
    table = [[cost(r, (t,)) for t in range(1001)] for r in range(64)]
    caps = sorted({c for row in table for c in row})
    best = next(c for c in caps if sum(sum(1 for x in row[1:] if x <= c) for row in table) >= 1000)
    assert part.peak == pytest.approx(best, rel=1e-12)


def test_bad_sizes_are_named():
    with pytest.raises(CaptureError, match="layers 0"):
        min_max_partition(0, 2, 1, lambda r, c: 0.0)


def test_within_answers_as_the_best_split_from_fewer_forecasts():
    """_Ranks.within (what the bisection's capacities ask) says whether a total's best split is
    within the cap, forecasting its splits only until one is: the answers of best, from fewer
    rank_peak calls."""
    rng = random.Random(11)
    spared = 0
    for _ in range(30):
        pp, vpp = rng.randint(2, 3), rng.randint(2, 4)
        cost = _random_cost(rng, pp, vpp)
        forecasts: list[tuple] = []

        def counted(r: int, c: tuple[int, ...], cost=cost, forecasts=forecasts) -> float:
            forecasts.append((r, c))
            return cost(r, c)

        ranks = _Ranks(pp, vpp, counted, 12)
        exact = _Ranks(pp, vpp, cost, 12)
        for cap in sorted(rng.uniform(0, 400) for _ in range(10)):
            for r, t in itertools.product(range(pp), range(9)):
                assert ranks.within(r, t, cap) == (exact.best(r, t)[0] <= cap)
        every = sum(len(_splits(t, vpp)) for t in range(9)) * pp
        assert len(set(forecasts)) == len(forecasts) <= every
        spared += every - len(forecasts)
    assert spared > 0


@pytest.mark.parametrize("recompute", [0, 2])
def test_rows_are_rank_peaks_and_the_split_is_the_same(recompute):
    """forecast.rows.peak_rows (the splits of a rank of many chunks in bulk) gives rank_peak's
    values to within rounding, and the min-max split with them is the split without them."""
    plan = ParallelPlan(tp=1, pp=2, dp=1, vpp=3, micro_batch_size=1, global_batch_size=8,
                        layers_per_stage=(2,) * 6, ddp=DdpOptions(),
                        recompute=Recompute("full", "block", (recompute,) * 2) if recompute
                        else Recompute())  # fmt: skip
    model = synthetic_source(needs_of(SMALL, [plan]))
    layers = layers_for(model, SMALL, plan)
    splits = np.array(list(itertools.product(range(5), repeat=3)))
    for rank in range(2):
        rows = peak_rows(layers, SMALL, plan, rank, splits)
        assert rows is not None
        for counts, row in zip(map(tuple, splits), rows):
            exact = rank_peak(layers, SMALL, plan, rank, counts)
            assert row == pytest.approx(exact, rel=1e-12, abs=0)
    full = bool(recompute)
    with_rows = min_max_partition(SMALL.num_layers, 2, 3, rank_peak_fn(model, SMALL, plan, full),
                                  rows=rank_rows_fn(model, SMALL, plan, full))  # fmt: skip
    without = min_max_partition(SMALL.num_layers, 2, 3, rank_peak_fn(model, SMALL, plan, full))
    assert with_rows == without


def test_a_move_re_forecasts_two_ranks_and_scores_as_a_whole_split():
    """contiguous._moved (descend's trial of one move) is evaluate_located of the moved split,
    forecasting only the two ranks whose stages the move changed."""
    rng = random.Random(5)
    for _ in range(200):
        pp, vpp = rng.randint(2, 4), rng.randint(2, 3)
        weight = [rng.uniform(1, 3) for _ in range(40)]  # layers differ by where they sit

        def peak(r: int, counts: tuple[int, ...], starts: tuple[int, ...], w=weight) -> float:
            return r + sum(
                sum(w[a : a + k]) * (v + 1) for v, (a, k) in enumerate(zip(starts, counts))
            )

        split = tuple(rng.randint(0, 3) for _ in range(pp * vpp))
        before = evaluate_located(split, pp, vpp, peak)
        i = rng.randrange(pp * vpp - 1)
        if not split[i]:
            continue
        moved = list(split)
        moved[i], moved[i + 1] = moved[i] - 1, moved[i + 1] + 1
        asked: list[int] = []

        def counted(r: int, c: tuple[int, ...], s: tuple[int, ...], asked=asked, f=peak) -> float:
            asked.append(r)
            return f(r, c, s)

        got = _moved(tuple(moved), before, (i % pp, (i + 1) % pp), pp, vpp, counted)
        assert got == evaluate_located(tuple(moved), pp, vpp, peak)
        assert sorted(set(asked)) == sorted({i % pp, (i + 1) % pp}) and len(asked) <= 2
