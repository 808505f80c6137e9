"""The exact min-max partition of N identical transformer layers over pp x vpp virtual stages.

Virtual stage i lives on pipeline rank i % pp (model order), the embedding on stage 0, the output
layer on the last; a stage may hold no transformer layers. The caller supplies
`rank_peak(pp_rank, chunk_counts) -> bytes`, nondecreasing in every count (the predictor's rank
simulation). Pure Python.

Method. For a cap C, rank r can hold at most T_r(C) layers (the largest total whose best split over
its chunks stays <= C; monotone, found by binary search). C is feasible iff sum_r T_r(C) >= N, and
the optimum C* is one of the rank_peak values, so a bisection on C that ends on the max over ranks
of the assignment it found is exact. Ties (every assignment whose peak is within 1e-9 of C*) are
broken toward balanced compute: the smallest possible maximum of layers per rank, then layers
removed first from the earliest ranks (they hold the most in-flight activations). Cost: O(pp log N)
rank_peak calls per bisection step (60 steps) with vpp = 1; with vpp = 2 each total is split over
the chunks by enumerating its splits (memoised), and so with more chunks while a total has at most
MOST_SPLITS splits; beyond, it is spread near-evenly (the chunks differ by at most one layer, the
extra ones on the first or the last chunks, whichever peaks lower): exact over those spreads, not
over every split. A capacity asks only whether a total's best split is within the cap, so its
splits are forecast until one is, the most even first (_Ranks.within). Given `rows` (beyond
TABLE_CHUNKS chunks), a rank's splits of every total are forecast at once in bulk
(capture_megatron.forecast.rows), and rank_peak is asked only where the rows' rounding could tip
a comparison (NEAR): the answers are rank_peak's."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from capture_megatron.errors import require

RankPeak = Callable[[int, tuple[int, ...]], float]
"""rank_peak(pp_rank, chunk_counts) -> predicted peak bytes."""
LocatedPeak = Callable[[int, tuple[int, ...], tuple[int, ...]], float]
"""peak(pp_rank, chunk_counts, chunk_starts) -> bytes: a rank's peak when its layers differ by where
they sit (dense and MoE layers mixed); chunk_starts: each chunk's first layer."""
Score = Callable[[tuple[int, ...]], "Partition"]
"""score(layers_per_stage) -> the split with its predicted peaks."""
RankTable = Callable[[int, int], np.ndarray]
"""table(pp_rank, limit) -> the rank's peak for every chunk count 0..limit (one axis per chunk),
equal to rank_peak's values (capture_megatron.forecast.table); used up to TABLE_CHUNKS chunks."""
RankRows = Callable[[int, np.ndarray], "np.ndarray | None"]
"""rows(pp_rank, splits) -> the rank's peak for each row of chunk counts, rank_peak's values to
within rounding (capture_megatron.forecast.rows), or None where they do not cover the rank; used
beyond TABLE_CHUNKS chunks."""
TIE = 1e-9
NEAR = 1e-12
"""How close to a cap (relative) a row's peak must be for _Ranks.within to ask rank_peak itself:
the rows sum in another order, so they may differ from rank_peak's by a few units of rounding."""
TABLE_CHUNKS = 2
"""Tables are used up to this many chunks per rank ((limit + 1) ** vpp entries)."""
MOST_SPLITS = 200
"""A rank's total is split over its chunks in every way when there are at most this many ways,
else near-evenly (the chunks differ by at most one layer)."""


@dataclass(frozen=True)
class Partition:
    """A split of the layers and its predicted peaks."""

    layers_per_stage: tuple[int, ...]
    """Transformer layers per virtual stage, in model order (stage i on rank i % pp)."""
    peak: float
    """Maximum over ranks of the predicted peak."""
    rank_peaks: tuple[float, ...]
    """Predicted peak of each pipeline rank."""


def _chunks(layers_per_stage: tuple[int, ...], pp: int, vpp: int, rank: int) -> tuple[int, ...]:
    return tuple(layers_per_stage[v * pp + rank] for v in range(vpp))


def evaluate(
    layers_per_stage: tuple[int, ...], pp: int, vpp: int, rank_peak: RankPeak
) -> Partition:
    """Score a given split."""
    peaks = tuple(rank_peak(r, _chunks(layers_per_stage, pp, vpp, r)) for r in range(pp))
    return Partition(tuple(layers_per_stage), max(peaks), peaks)


def evaluate_located(
    layers_per_stage: tuple[int, ...], pp: int, vpp: int, peak: LocatedPeak
) -> Partition:
    """Score a given split whose layers differ by where they sit."""
    split = tuple(layers_per_stage)
    starts = [0, *itertools.accumulate(split)]  # each stage's first layer
    peaks = tuple(
        peak(r, _chunks(split, pp, vpp, r), tuple(starts[v * pp + r] for v in range(vpp)))
        for r in range(pp)
    )
    return Partition(split, max(peaks), peaks)


@functools.lru_cache(maxsize=4096)
def _splits(total: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """The splits of `total` layers over vpp chunks that _Ranks weighs: every one while there are
    at most MOST_SPLITS, else the near-even spreads (the chunks differ by at most one layer, the
    extra layers on the first or on the last chunks); the most even first."""
    if vpp == 1:
        return ((total,),)
    if math.comb(total + vpp - 1, vpp - 1) > MOST_SPLITS:
        q, extra = divmod(total, vpp)
        first = tuple(q + (v < extra) for v in range(vpp))
        return tuple(dict.fromkeys((first, first[::-1])))
    splits = []
    for cut in itertools.combinations(range(total + vpp - 1), vpp - 1):
        bounds = (-1,) + cut + (total + vpp - 1,)
        splits.append(tuple(bounds[i + 1] - bounds[i] - 1 for i in range(vpp)))
    return tuple(sorted(splits, key=max))


class _Ranks:
    """Memoised best split of t layers over one rank's chunks, per rank."""

    def __init__(
        self, pp: int, vpp: int, rank_peak: RankPeak, limit: int, rows: RankRows | None = None
    ):
        self.pp, self.vpp, self.rank_peak, self.limit = pp, vpp, rank_peak, limit
        self.rows = rows
        self.curves: dict[int, np.ndarray | None] = {}
        """Per rank, from `rows`: the lowest peak of each total's splits (0..limit)."""
        self.rowed: dict[int, list[np.ndarray]] = {}
        """Per rank, from `rows`: the peaks of each total's splits (_splits' order)."""
        self.rising: set[int] = set()
        """The ranks whose curve never falls as the total grows: a capacity is then where the
        cap cuts it (what the bisection over totals finds)."""
        self.best = functools.lru_cache(maxsize=None)(self._best)
        self.seen: dict[int, list[tuple[float, int]]] = {}
        self.tried: dict[tuple[int, int], tuple[int, float]] = {}
        """Per (rank, total): how many of its splits (_splits' order) `within` has forecast, and
        the lowest of their peaks."""

    def _best(self, rank: int, total: int) -> tuple[float, tuple[int, ...]]:
        """(cost, split) minimising the rank's peak for `total` layers (ties: most even split)."""
        splits = _splits(total, self.vpp)
        if self._rows_curve(rank) is not None:  # rank_peak only for the splits the rows put within
            peaks = self.rowed[rank][total]  # rounding of the lowest (the best is among them)
            low = peaks.min()
            splits = tuple(s for s, p in zip(splits, peaks) if p - low <= NEAR * max(low, 1.0))
        options = [(self.rank_peak(rank, s), max(s), s) for s in splits]
        cost, _, split = min(options)
        return cost, split

    def within(self, rank: int, total: int, cap: float) -> bool:
        """Whether best(rank, total) is within `cap`: some split of the total is, so its splits
        are forecast only until one is (the most even first), resumed where the last call left."""
        curve = self._rows_curve(rank)
        if curve is not None:
            near = curve[total]
            if abs(near - cap) > NEAR * max(abs(cap), 1.0):  # rounding cannot tip it
                return bool(near <= cap)
        splits = _splits(total, self.vpp)
        done, low = self.tried.get((rank, total), (0, math.inf))
        while low > cap and done < len(splits):
            low, done = min(low, self.rank_peak(rank, splits[done])), done + 1
        self.tried[rank, total] = done, low
        return low <= cap

    def _rows_curve(self, rank: int) -> np.ndarray | None:
        """The lowest peak of every total's splits on `rank`, from one call of `rows` (None:
        no rows)."""
        if rank not in self.curves and self.rows is not None:
            each = [_splits(t, self.vpp) for t in range(self.limit + 1)]
            peaks = self.rows(rank, np.array([s for splits in each for s in splits], np.int64))
            starts = np.cumsum([0] + [len(splits) for splits in each[:-1]])
            curve = None if peaks is None else np.minimum.reduceat(peaks, starts)
            self.curves[rank] = curve
            if peaks is not None:
                self.rowed[rank] = np.split(peaks, starts[1:])
            if curve is not None and bool(np.all(np.diff(curve) >= 0)):
                self.rising.add(rank)
        return self.curves.get(rank)

    def capacity(self, rank: int, cap: float) -> int:
        """Most layers the rank holds under `cap` (-1 when even 0 layers exceed it). Capacity is
        monotone in the cap, so earlier answers for smaller/larger caps bracket the search."""
        curve = self._rows_curve(rank)
        if curve is not None and rank in self.rising:  # the curve's answer, unless rounding
            i = int(np.searchsorted(curve, cap, side="right"))  # could tip it
            near = [curve[j] for j in (i - 1, i) if 0 <= j < len(curve)]
            if all(abs(x - cap) > NEAR * max(abs(cap), 1.0) for x in near):
                return i - 1
        if not self.within(rank, 0, cap):
            return -1
        seen = self.seen.setdefault(rank, [])
        i = bisect.bisect_left(seen, (cap, -1))
        lo = seen[i - 1][1] if i > 0 else 0
        hi = seen[i][1] if i < len(seen) else self.limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.within(rank, mid, cap):
                lo = mid
            else:
                hi = mid - 1
        bisect.insort(seen, (cap, lo))
        return lo


class _TableRanks(_Ranks):
    """_Ranks on bulk tables (one or two chunks per rank): each rank's table of peaks over its
    chunk counts, and the curve of the best split's peak for every total, grown by doubling the
    largest count as totals beyond it are asked for."""

    def __init__(self, pp: int, vpp: int, rank_peak: RankPeak, limit: int, table: RankTable):
        super().__init__(pp, vpp, rank_peak, limit)
        self.table = table
        self.tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _curve(self, rank: int, total: int) -> tuple[np.ndarray, np.ndarray]:
        """(table, best peak for every total 0..its largest count) covering `total`."""
        have = self.tables.get(rank)
        if have is None or len(have[1]) <= total:
            size = 2 * (len(have[1]) - 1) if have is not None else 2 * -(-self.limit // self.pp) + 2
            table = self.table(rank, min(max(total, size), self.limit))
            if self.vpp == 1:
                curve = table
            else:  # minimum over each anti-diagonal a + b = t with t <= the largest count
                k = table.shape[0]
                curve = np.full(2 * k - 1, np.inf)
                np.minimum.at(
                    curve, np.add.outer(np.arange(k), np.arange(k)).ravel(), table.ravel()
                )
                curve = curve[:k]
            have = (table, curve)
            self.tables[rank] = have
        return have

    def _best(self, rank: int, total: int) -> tuple[float, tuple[int, ...]]:
        """As _Ranks._best, read from the table."""
        table, curve = self._curve(rank, total)
        if self.vpp == 1:
            return float(table[total]), (total,)
        first = np.arange(total + 1)
        costs = table[first, total - first]
        low = costs.min()
        a = min(np.flatnonzero(costs == low), key=lambda i: (max(i, total - i), i))
        return float(low), (int(a), total - int(a))

    def capacity(self, rank: int, cap: float) -> int:
        """The largest total whose best split stays <= cap (-1 when none does)."""
        curve = self._curve(rank, 0)[1]
        while True:
            fits = np.flatnonzero(curve <= cap)
            if not len(fits):
                return -1
            if fits[-1] < len(curve) - 1 or len(curve) > self.limit:
                return int(fits[-1])
            curve = self._curve(rank, len(curve))[1]


def _feasible(ranks: _Ranks, n: int, cap: float) -> bool:
    caps = [ranks.capacity(r, cap) for r in range(ranks.pp)]
    return min(caps) >= 0 and sum(caps) >= n


def _table_cap(ranks: _TableRanks, n: int, hi: float) -> float:
    """C* on tables: the smallest of the ranks' best-split peaks (each curve grown to what `hi`
    needs first) under which all ranks hold n layers -- a bisection over those values."""
    for r in range(ranks.pp):
        ranks.capacity(r, hi)
    values = np.unique(np.concatenate([ranks.tables[r][1] for r in range(ranks.pp)]))
    values = values[values <= hi]
    lo, top = 0, len(values) - 1  # values[top] == hi is feasible
    while lo < top:
        mid = (lo + top) // 2
        if _feasible(ranks, n, float(values[mid])):
            top = mid
        else:
            lo = mid + 1
    return float(values[top])


def _bisect_cap(ranks: _Ranks, n: int) -> float:
    """The optimal cap C* (exact: ends on an achieved rank_peak value)."""
    pp = ranks.pp
    hi = max(ranks.best(r, -(-n // pp))[0] for r in range(pp))  # a feasible cap: the even split
    if isinstance(ranks, _TableRanks):
        return _table_cap(ranks, n, hi)
    lo = min(ranks.best(r, 0)[0] for r in range(pp))
    for _ in range(200):
        if hi - lo <= TIE * max(abs(hi), 1.0):
            break
        mid = (lo + hi) / 2
        if _feasible(ranks, n, mid):
            hi = mid
        else:
            lo = mid
    return hi


def _balanced(caps: list[int], n: int) -> list[int]:
    """Totals <= caps summing to n with the smallest maximum; the excess is taken one layer at a
    time from the earliest rank holding the current maximum."""
    lo, hi = -(-n // len(caps)), max(caps)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(min(c, mid) for c in caps) >= n:
            hi = mid
        else:
            lo = mid + 1
    totals = [min(c, lo) for c in caps]
    for _ in range(sum(totals) - n):
        top = max(totals)
        totals[totals.index(top)] -= 1
    return totals


def min_max_partition(
    num_layers: int,
    pp: int,
    vpp: int,
    rank_peak: RankPeak,
    unit: int = 1,
    table: RankTable | None = None,
    rows: RankRows | None = None,
) -> Partition:
    """The split of `num_layers` minimising the largest rank peak (see the module docstring), every
    chunk holding a multiple of `unit` layers (uniform recompute of `unit` layers at a time);
    `table`, when given, supplies the same peaks in bulk (faster, identical result), and `rows`
    those of more chunks (for the capacities; identical result)."""
    require(
        [
            f"{name} {val} must be >= 1"
            for name, val in (("layers", num_layers), ("pp", pp), ("vpp", vpp), ("unit", unit))
            if val < 1
        ]
        + (["virtual stages need pp > 1"] if vpp > 1 and pp == 1 else [])
        + (
            [f"{num_layers} layers cannot be split in groups of {unit} (uniform recompute)"]
            if num_layers % unit
            else []
        ),
        "partition",
    )
    if unit > 1:
        part = min_max_partition(
            num_layers // unit, pp, vpp, lambda r, c: rank_peak(r, tuple(unit * k for k in c))
        )
        return evaluate(tuple(unit * k for k in part.layers_per_stage), pp, vpp, rank_peak)
    ranks = (
        _TableRanks(pp, vpp, rank_peak, num_layers, table)
        if table is not None and vpp <= TABLE_CHUNKS
        else _Ranks(pp, vpp, rank_peak, num_layers, rows)
    )
    cap = _bisect_cap(ranks, num_layers)
    caps = [ranks.capacity(r, cap * (1 + TIE)) for r in range(pp)]
    totals = _balanced(caps, num_layers)
    layers = [0] * (pp * vpp)
    for r, t in enumerate(totals):
        for v, k in enumerate(ranks.best(r, t)[1]):
            layers[v * pp + r] = k
    return evaluate(tuple(layers), pp, vpp, rank_peak)
