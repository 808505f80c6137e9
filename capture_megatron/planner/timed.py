"""The time-aware partition (the throughput objective): for a plan's sizes, the contiguous split of
the layers over the pipeline ranks and their virtual chunks, with the per-stage full-recompute
counts, that minimises the estimated step while every rank's predicted peak plus margins fits the
memory cap (MadPipe's bottleneck under a memory cap). Pure Python.

The step (capture_megatron.steptime.model) is m x the slowest rank's per-micro-batch time plus the
other ranks' slowest chunks (fill and drain), the pipeline sends, the data-parallel share left
exposed and the optimizer step. For identical layers a rank's time depends on how many layers it
holds and how many it recomputes, its memory on how they spread over its chunks. So, per rank and
layer count k, the best way to hold k layers (`RankChoice`): the chunk split and the fewest
recomputed layers that fit (recompute where it is needed, on that rank only), ranked fastest, then
the narrowest chunk, then the lowest peak. A rank's best time grows with k (a layer removed never
adds memory or time), so for a bottleneck B each rank holds at most cap_r(B) layers; the smallest
B whose capacities hold every layer (a bisection, as the min-max memory partition's) is the least
bottleneck B* any fitting split can have. Splits are then built for B* and the next larger
bottlenecks (the layers spread to the smallest most-per-rank), each estimated in full, until

    lower bound = (m - 1/v) B + W / v + rest + exposed(B)

for the next B is no better than the best found (W: the ranks' least total time, rest: the sends,
the DP collectives not overlapped, the mean rank's optimizer step; exposed(B): the overlapped DP
collectives less B, the longest window a rank's micro-batch can give them; every split of
bottleneck >= B costs at least the least of this over B' >= B, since the fill and drain wait at
least each other rank's time / v; stepbound.BoundParts). The
bound is returned with the split: the split is proven within `bound` of the fastest. Given a step
to beat, the capacities at the bottleneck where the bound reaches it (ranktimes.beyond) come first:
where they do not hold the layers, no split that fits can win, and the plan is left (Beaten).

Chunk splits searched: every split with one or two chunks per rank; with more, the near-even ones
(chunks differing by at most one layer, the extra layers on the first or on the last chunks), so
the bound then covers those splits only. Dense and MoE layers mixed are handled elsewhere
(capture_megatron.planner.search: the min-max memory split with trimmed recompute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from operator import attrgetter

from capture_megatron.config import ModelShape, ParallelPlan, Recompute
from capture_megatron.fit import MemoryModel
from capture_megatron.forecast import layers_for, rank_peak
from capture_megatron.forecast.chunkmemo import ChunkMemos, chunk_memo
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.partition import TIE
from capture_megatron.planner.ranktimes import RankTimes, beyond, chunk_splits, lower_bound
from capture_megatron.planner.stepbound import bound_parts
from capture_megatron.steptime import parts as cp
from capture_megatron.steptime.model import CostModel, step_seconds

MORE_BOTTLENECKS = 12
"""Bottlenecks above the least one tried at most (the bound covers the ones not tried)."""


@dataclass(frozen=True)
class RankChoice:
    """One pipeline rank's best way to hold some layers."""

    time: float
    """Its per-micro-batch seconds, every chunk's forward and backward (recompute included)."""
    widest: float
    """Its slowest chunk's seconds (what the fill and drain wait for)."""
    peak: float
    """Its predicted peak (bytes)."""
    chunks: tuple[int, ...]
    """Layers of each of its chunks."""
    recompute: int
    """Full-recompute count n of the rank (0 without recompute)."""


_FASTEST = attrgetter("time", "widest", "peak")
"""How a rank's best way to hold its layers is ranked (_Ranks.best)."""
_NARROWEST = attrgetter("widest", "time", "peak")
"""How a rank that is not the slowest ranks its ways within the time limit (_Ranks.narrowest)."""


@dataclass(frozen=True)
class Beaten:
    """No split of a plan's sizes that fits is estimated faster than the step it had to beat."""

    bottleneck: float
    """A lower bound on the slowest-rank per-micro-batch time of any split that fits."""


@dataclass(frozen=True)
class TimedSplit:
    """The time-aware split of a plan's sizes."""

    plan: ParallelPlan
    """The plan with its split and recompute counts."""
    seconds: float
    """Its estimated step."""
    bound: float
    """No split of the searched family with these sizes and recompute granularity that fits is
    estimated faster than this (seconds)."""
    bottleneck: float
    """The least slowest-rank per-micro-batch time of a split that fits (B*, within TIE)."""


class _Ranks(RankTimes):
    """Each rank's RankChoice for every layer count, computed when asked and memoised."""

    def __init__(
        self,
        model: MemoryModel,
        shape: ModelShape,
        plan: ParallelPlan,
        cap: float,
        margins: Margins,
        hw: CostModel,
        choose: bool,
        floor: int = 0,
        memos: ChunkMemos | None = None,
    ) -> None:
        super().__init__(shape, plan, hw)
        self.cap, self.margins = cap, margins
        self.choose = choose
        """Whether the full-recompute counts are chosen (else the plan's are kept)."""
        self.floor = floor
        """The fewest layers a chosen count recomputes (1: full recompute was asked for)."""
        self.layers = layers_for(model, shape, plan)
        self.cache = chunk_memo(memos, self.layers, plan)
        self.peaks: dict[tuple, float] = {}
        self.plans: dict[tuple[int, int], ParallelPlan] = {}
        self.best_of: dict[tuple[int, int], RankChoice | None] = {}
        self.fewest_of: dict[int, dict[tuple[int, ...], int | None]] = {}
        """Per rank, the fewest recomputed layers per chunk of each chunk split (None: none fit)."""

    def _with(self, rank: int, n: int) -> ParallelPlan:
        """The plan with rank `rank` recomputing n layers (the count only that rank reads)."""
        rc = self.plan.recompute
        if not self.choose:
            return self.plan
        if (rank, n) not in self.plans:
            counts = tuple(n if r == rank else 0 for r in range(self.plan.pp))
            self.plans[rank, n] = replace(self.plan, recompute=Recompute("full", rc.method, counts))
        return self.plans[rank, n]

    def fits(self, rank: int, chunks: tuple[int, ...], n: int) -> float | None:
        """The rank's peak holding `chunks` recomputing n, or None when it does not fit."""
        peak = self.peaks.get((rank, chunks, n))
        if peak is None:
            at = (self.layers, self.shape, self._with(rank, n), rank, chunks, self.cache)
            peak = self.peaks[rank, chunks, n] = rank_peak(*at)
        return peak if self.margins.plan_needed(peak, self.shape, self.plan) <= self.cap else None

    def _fewest(self, rank: int, chunks: tuple[int, ...]) -> tuple[int, float] | None:
        """(n, peak): the fewest recomputed layers per chunk with which `chunks` fit (the plan's
        count when it is kept), or None."""
        if not self.choose:
            n = self.plan.recompute.layers_on(rank)
            peak = self.fits(rank, chunks, n)
            return None if peak is None else (n, peak)
        known = self.fewest_of.setdefault(rank, {})
        if chunks not in known:
            known[chunks] = self._search_fewest(rank, chunks, known)
        fewest = known[chunks]
        if fewest is None:
            return None
        peak = self.fits(rank, chunks, fewest)
        assert peak is not None
        return fewest, peak

    def _search_fewest(
        self, rank: int, chunks: tuple[int, ...], known: dict[tuple[int, ...], int | None]
    ) -> int | None:
        """_fewest's count, searched between the counts of the rank's splits known that hold
        one layer fewer in one chunk (a lower bound, or none fits) and one more (an upper
        bound): a layer more, recomputed or not, never needs less memory."""
        top = max(chunks, default=0)
        lo, hi, proven = min(self.floor, top), top, False
        for j in range(len(chunks)):
            less = known.get(chunks[:j] + (chunks[j] - 1,) + chunks[j + 1 :], -1)
            if less is None:
                return None
            lo = max(lo, less)
            more = known.get(chunks[:j] + (chunks[j] + 1,) + chunks[j + 1 :])
            if more is not None and more < hi:
                hi, proven = more, True
        if lo > hi:  # not monotone after all: search the whole range
            lo, hi, proven = min(self.floor, top), top, False
        if self.fits(rank, chunks, lo) is not None:
            return lo
        if not proven and self.fits(rank, chunks, hi) is None:
            return None
        while lo < hi:  # fits(hi); recomputing more never needs more memory
            mid = (lo + hi) // 2
            if self.fits(rank, chunks, mid) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def best(self, rank: int, k: int) -> RankChoice | None:
        """The fastest way for `rank` to hold k layers that fits (then the narrowest slowest chunk,
        then the lowest peak), or None."""
        key = (rank, k)
        if key in self.best_of:
            return self.best_of[key]
        found: RankChoice | None = None
        splits = [(self.seconds(rank, c, 0), c) for c in chunk_splits(k, self.plan.vpp)]
        floor = min(t for (t, _), _ in splits)  # no recompute: the least time
        for (_, narrowest), chunks in sorted(splits, key=lambda x: (x[0][1], x[1])):
            fastest = found is not None and found.time <= floor * (1 + TIE)
            if fastest and found is not None and narrowest > found.widest * (1 + TIE):
                break  # the least time is found and every later split is wider
            fewest = self._fewest(rank, chunks)
            if fewest is None:
                continue
            time, widest = self.seconds(rank, chunks, fewest[0])
            option = RankChoice(time, widest, fewest[1], chunks, fewest[0])
            if found is None or _FASTEST(option) < _FASTEST(found):
                found = option
        self.best_of[key] = found
        return found

    def narrowest(self, rank: int, k: int, limit: float) -> RankChoice | None:
        """For a rank that is not the slowest: of its ways to hold k layers within the cap and
        `limit` seconds, the one with the narrowest slowest chunk (what the fill and drain wait
        for), then the fastest, then the lowest peak."""
        found = self.best(rank, k)
        if found is None or self.plan.vpp == 1:
            return found
        splits = sorted((self.seconds(rank, c, 0)[1], c) for c in chunk_splits(k, self.plan.vpp))
        for least, chunks in splits:
            if least > found.widest * (1 + TIE):
                break
            fewest = self._fewest(rank, chunks)
            if fewest is None:
                continue
            time, widest = self.seconds(rank, chunks, fewest[0])
            option = RankChoice(time, widest, fewest[1], chunks, fewest[0])
            if time <= limit and _NARROWEST(option) < _NARROWEST(found):
                found = option
        return found

    def time(self, rank: int, k: int) -> float:
        """The rank's best time for k layers within the cap (inf when they do not fit)."""
        choice = self.best(rank, k) if 0 <= k <= self.shape.num_layers else None
        return float("inf") if choice is None else choice.time

    def capacity(self, rank: int, limit: float, start: int = 0) -> int:
        """The most layers the rank holds within the cap at a time <= `limit` (-1: none); at
        least `start` (a capacity known for a smaller limit: searched upward from it, doubling
        the step, so a limit raised a little costs a probe or two)."""
        top = max(start, self.held(rank, limit))  # the most without recompute: an upper bound
        if not start and self.time(rank, top) <= limit:
            return top
        if self.time(rank, start) > limit:  # the time grows with the layers
            return -1
        lo, hi, step = start, top, 1
        while start and lo + step <= top and self.time(rank, lo + step) <= limit:
            lo, step = lo + step, 2 * step
        if start:
            hi = min(lo + step, top + 1)
        return self._bisect(rank, limit, lo, hi)

    def _bisect(self, rank: int, limit: float, lo: int, hi: int) -> int:
        """The most layers within `limit` between lo (within it) and hi (beyond it or the bound)."""
        while lo < hi - 1:
            mid = (lo + hi) // 2
            if self.time(rank, mid) <= limit:
                lo = mid
            else:
                hi = mid
        return lo


def _least_bottleneck(
    ranks: _Ranks, n: int, cut: float = math.inf
) -> tuple[float, list[int]] | float | None:
    """(B*, each rank's capacity at B*): the least slowest-rank time of a split of n layers that
    fits, found upward from the least one without memory (each step raises the limit to the next
    rank time that lets some rank hold one more layer); None when no split fits; `cut` when B*
    is above it (the ranks' capacities at `cut` do not hold the layers; searched no further)."""
    pp = ranks.plan.pp
    if cut < math.inf and not _hold(ranks, n, cut):
        return cut
    limit = ranks.least_bottleneck()[1] * (1 + TIE)
    caps = [ranks.capacity(r, limit) for r in range(pp)]
    while min(caps) < 0 or sum(caps) < n:
        more = [ranks.time(r, caps[r] + 1) for r in range(pp)]
        if min(more) == float("inf"):
            return None
        limit = min(more) * (1 + TIE)
        caps = [ranks.capacity(r, limit, max(c, 0)) for r, c in enumerate(caps)]
    return max(ranks.time(r, c) for r, c in enumerate(caps) if c >= 0), caps


def _hold(ranks: _Ranks, n: int, limit: float) -> bool:
    """Whether the ranks' capacities at `limit` hold n layers, each rank's asked only while the
    others' most without memory (RankTimes.held, no fewer than their capacities) may still make
    up the rest."""
    upper = [ranks.held(r, limit) for r in range(ranks.plan.pp)]
    total = sum(upper)
    for r, most in enumerate(upper):
        if total < n:
            return False
        cap = ranks.capacity(r, limit)
        if cap < 0:
            return False
        total += cap - most
    return total >= n


def _spread(caps: list[int], n: int, extra: list[float], per_layer: float) -> list[int]:
    """Layers per rank within `caps` summing to n with the smallest most parameters on a rank
    (each layer `per_layer`, rank r `extra[r]` more: the embedding, the output layer), which the
    optimizer step and the gradient reduce wait for; the excess taken from the ranks holding the
    most, the earliest first (they keep the most micro-batches in flight)."""

    def most(limit: float) -> list[int]:
        return [min(c, max(int((limit - e) / per_layer + TIE), 0)) for c, e in zip(caps, extra)]

    values = sorted({k * per_layer + e for c, e in zip(caps, extra) for k in range(c + 1)})
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(most(values[mid])) >= n:
            hi = mid
        else:
            lo = mid + 1
    totals = most(values[lo])
    for _ in range(sum(totals) - n):  # from ranks that hold layers: an end alone may weigh most
        holding = [r for r in range(len(totals)) if totals[r] > 0]
        heaviest = max(holding, key=lambda r: (totals[r] * per_layer + extra[r], -r))
        totals[heaviest] -= 1
    return totals


def _assemble(ranks: _Ranks, totals: list[int]) -> tuple[ParallelPlan, float]:
    """(the plan with each rank's way to hold its total -- the fastest on the slowest rank, the
    narrowest within its time on the others --, the worst rank's peak)."""
    plan, pp = ranks.plan, ranks.plan.pp
    limit = max(ranks.time(r, k) for r, k in enumerate(totals))
    choices = [ranks.narrowest(r, k, limit * (1 + TIE)) for r, k in enumerate(totals)]
    layers = [0] * (pp * plan.vpp)
    for r, c in enumerate(choices):
        assert c is not None
        for v, k in enumerate(c.chunks):
            layers[v * pp + r] = k
    rc = plan.recompute
    if ranks.choose:
        counts = tuple(c.recompute for c in choices if c is not None)
        rc = Recompute("full", "block", counts) if any(counts) else Recompute()
    peak = max(c.peak for c in choices if c is not None)
    return replace(plan, layers_per_stage=tuple(layers), recompute=rc), peak


def timed_split(
    model: MemoryModel,
    shape: ModelShape,
    plan: ParallelPlan,
    cap: float,
    margins: Margins,
    hw: CostModel,
    choose: bool,
    floor: int = 0,
    memos: ChunkMemos | None = None,
    beat: float = math.inf,
) -> TimedSplit | Beaten | None:
    """The fastest split of the plan's sizes that fits `cap` (module docstring; `choose`: full
    recompute's per-stage counts are chosen, the fewest that fit; else the plan's recompute is
    kept; `floor`: the fewest layers a chosen count recomputes; `memos`: chunk costs shared with
    the search's other plans); None when no split fits; Beaten once the bound proves that no
    split that fits is faster than `beat` seconds (searched no further). Layers of one kind only
    (not dense and MoE mixed)."""
    if choose:
        plan = replace(plan, recompute=Recompute("full", "block", (0,) * plan.pp))
    ranks = _Ranks(model, shape, plan, cap, margins, hw, choose, floor, memos)
    n = shape.num_layers
    parts = bound_parts(shape, plan, hw)
    m, pp, vpp = plan.num_microbatches, plan.pp, plan.vpp
    least = _least_bottleneck(ranks, n, beyond(parts, m, vpp, beat, ranks.least_bottleneck()[1]))
    if least is None or isinstance(least, float):
        return None if least is None else Beaten(least)
    bottleneck, caps = least
    per_layer = cp.layer_params(shape, plan.tp)
    extra = [cp.end_params(shape, plan.tp, r == 0, r == pp - 1) for r in range(pp)]
    best: tuple[float, float, ParallelPlan] | None = None
    for _ in range(MORE_BOTTLENECKS + 1):
        split, peak = _assemble(ranks, _spread(caps, n, extra, per_layer))
        found = (step_seconds(shape, split, hw), peak, split)
        if best is None or found[:2] < best[:2]:
            best = found
        more = min(ranks.time(r, caps[r] + 1) for r in range(pp))
        if more == float("inf") or lower_bound(parts, m, vpp, more) >= min(best[0], beat):
            break
        caps = [ranks.capacity(r, more * (1 + TIE), c) for r, c in enumerate(caps)]
    assert best is not None
    lower = min(best[0], lower_bound(parts, m, vpp, bottleneck))
    return TimedSplit(best[2], best[0], lower, bottleneck)
