"""The exact min-max partition of N transformer layers that differ (dense and MoE layers mixed by
--moe-layer-freq) over pp pipeline ranks with one chunk each (pure Python).

The caller supplies `range_peak(pp_rank, start, count) -> bytes`: the rank's predicted peak holding
layers start .. start + count - 1, nondecreasing when the range grows on either side (a layer more
never lowers a rank's memory). A stage's cost now depends on which layers it holds, not only on
how many, so the capacities of capture_megatron.planner.partition do not apply; contiguity does.

Method. For a cap C and a most-layers-per-rank M, fill the ranks from the last: each takes the most
layers ending where the next one starts that keep it <= C (and <= M); rank 0 takes the rest. This
greedy is exact for feasibility: if any split fits, the greedy boundary of every rank lies at or
before that split's (induction from the last rank; by monotonicity a sub-range of a fitting range
fits). The optimum C* is one of the range_peak values, so a bisection on C ending on the peak of
the split it found is exact. Ties (splits within 1e-9 of C*) are broken as the partitioner of
identical layers breaks them: the smallest M, then layers kept off the earliest ranks (they hold
the most in-flight activations)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

from capture_megatron.errors import require
from capture_megatron.planner.partition import TIE, LocatedPeak, Partition, evaluate_located

RangePeak = Callable[[int, int, int], float]
"""range_peak(pp_rank, start, count) -> predicted peak bytes."""


def _fill(n: int, pp: int, peak: RangePeak, cap: float, most: int, unit: int) -> list[int] | None:
    """Layers per rank (multiples of `unit`), filled from the last rank, each <= `most` and its
    peak <= `cap`; None when no such split exists."""
    counts, end = [0] * pp, n
    for r in reversed(range(1, pp)):
        if peak(r, end, 0) > cap:
            return None
        lo, hi = 0, min(most, end) // unit  # in units; lo always fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if peak(r, end - mid * unit, mid * unit) <= cap:
                lo = mid
            else:
                hi = mid - 1
        counts[r], end = lo * unit, end - lo * unit
    if end > most or peak(0, 0, end) > cap:
        return None
    counts[0] = end
    return counts


def _fewest(n: int, pp: int, peak: RangePeak, cap: float, unit: int) -> list[int]:
    """The split under `cap` with the smallest most-layers-per-rank (filled from the last)."""
    lo, hi = -(-n // pp), n
    while lo < hi:
        mid = (lo + hi) // 2
        if _fill(n, pp, peak, cap, mid, unit) is not None:
            hi = mid
        else:
            lo = mid + 1
    found = _fill(n, pp, peak, cap, lo, unit)
    assert found is not None  # the cap is feasible with most = n
    return found


def contiguous_partition(
    num_layers: int, pp: int, range_peak: RangePeak, unit: int = 1
) -> Partition:
    """The split of `num_layers` differing layers minimising the largest rank peak (see the module
    docstring), every rank holding a multiple of `unit` layers (uniform recompute)."""
    require(
        [f"{num_layers} layers cannot be split in groups of {unit}"] if num_layers % unit else [],
        "partition",
    )
    peak = functools.cache(range_peak)
    n = num_layers

    def worst(counts: list[int]) -> float:
        starts = [sum(counts[:r]) for r in range(pp)]
        return max(peak(r, starts[r], counts[r]) for r in range(pp))

    hi = worst(_fewest(n, pp, peak, float("inf"), unit))  # a feasible cap: the most even split
    lo = min(peak(r, 0, 0) for r in range(pp))
    for _ in range(200):
        if hi - lo <= TIE * max(abs(hi), 1.0):
            break
        mid = (lo + hi) / 2
        if _fill(n, pp, peak, mid, n, unit) is not None:
            hi = mid
        else:
            lo = mid
    counts = _fewest(n, pp, peak, hi * (1 + TIE), unit)
    starts = [sum(counts[:r]) for r in range(pp)]
    peaks = tuple(peak(r, starts[r], counts[r]) for r in range(pp))
    return Partition(tuple(counts), max(peaks), peaks)


def descend(
    split: tuple[int, ...], pp: int, vpp: int, peak: LocatedPeak, unit: int = 1
) -> Partition:
    """A local search from `split` over pp x vpp virtual stages (`peak`: a rank's peak by its
    chunks' counts and starts): move `unit` layers between neighbouring virtual stages while that
    lowers the peaks (the largest first, then the next largest, ...); for interleaved stages,
    where the exact method above does not apply. Ends at a split no single move improves. A move
    changes two stages' counts and the second's start, so only their ranks are forecast again."""
    best = evaluate_located(split, pp, vpp, peak)

    def rank(p: Partition) -> tuple[float, ...]:
        return tuple(sorted(p.rank_peaks, reverse=True))

    improved = True
    while improved:
        improved = False
        for i, (src, dst) in itertools.product(range(len(split) - 1), ((0, 1), (1, 0))):
            layers = list(best.layers_per_stage)
            if layers[i + src] < unit:
                continue
            layers[i + src] -= unit
            layers[i + dst] += unit
            trial = _moved(tuple(layers), best, (i % pp, (i + 1) % pp), pp, vpp, peak)
            if rank(trial) < rank(best):
                best, improved = trial, True
    return best


def _moved(
    split: tuple[int, ...],
    before: Partition,
    ranks: tuple[int, int],
    pp: int,
    vpp: int,
    peak: LocatedPeak,
) -> Partition:
    """evaluate_located of `split`, which differs from `before`'s only on `ranks`' stages: the
    other ranks' peaks are `before`'s."""
    peaks, first = list(before.rank_peaks), [0, *itertools.accumulate(split)]
    for r in set(ranks):
        counts = tuple(split[v * pp + r] for v in range(vpp))
        peaks[r] = peak(r, counts, tuple(first[v * pp + r] for v in range(vpp)))
    return Partition(split, max(peaks), tuple(peaks))
