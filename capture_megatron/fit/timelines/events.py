"""Transient peaks and saved bytes across shapes: replayed allocation timelines (pure Python + numpy).

A forward, backward or optimizer step's peak is the maximum of a running sum of allocations and
releases. Which temporaries coexist at the maximum changes with the shape, so one linear regression
of the peak cannot follow it (leave-one-out errors of 20-860%). Each single allocation, though, is
one tensor whose bytes are a product of sizes times the element size. So the profiler records every
window's events in order (records.Timeline), and this module

1. aligns the event sequences of all probed shapes into one union sequence (peak_align: the same op
   and the same multiple of a size term; a release matched through its allocation),
2. fits each event's bytes exactly on the fewest terms of terms.TRANSIENT_TERMS (1, then 2, then 3;
   split on one shape condition when no single formula fits; least squares only when nothing is exact),
3. learns when an event happens at all: some only exist for some shapes (a reshape is a view when one
   sequence or one head per rank makes it contiguous, a copy otherwise), described by a conjunction
   (or a negated one) of at most two literals over PREDICATES,
4. predicts a shape's peak by replaying the events that happen at that shape with their fitted bytes,
   and what the window leaves allocated (a forward's saved activations) from the same events.
"""
from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from capture_megatron.fit.timelines.align import align
from capture_megatron.records import Timeline
from capture_megatron.serial import JsonMixin
from capture_megatron.fit.terms import TRANSIENT_TERMS, Sizes

PREDICATES = {
    "b=1": lambda z: z.b == 1,
    "t=1": lambda z: z.t == 1,
    "g=a": lambda z: z.g == z.a,
    "g=t": lambda z: z.g == z.t,
    "a=t": lambda z: z.a == z.t,
    "b=1&g=t": lambda z: z.b == 1 and z.g == z.t,
    "b=1&a=t": lambda z: z.b == 1 and z.a == z.t,
}
"""Shape conditions under which torch takes a different path (view instead of copy, no collective)."""
LOO_FOLDS = 8
"""Shapes left out in turn for the leave-one-out error (evenly spread)."""
SNAP = 64.0
"""Exact coefficients are looked for on a grid of 1/SNAP bytes per term unit."""


def _holds(literals: tuple[str, ...], z: Sizes) -> bool:
    return all(PREDICATES[w.lstrip("!")](z) != w.startswith("!") for w in literals)


@dataclass(frozen=True)
class PeakEvent(JsonMixin):
    """One allocation or release of the union sequence."""

    op: str
    """'+name' for a storage the op allocates, '-name' for the release of one it allocated."""
    terms: tuple[str, ...]
    """Terms (terms.TRANSIENT_TERMS) the bytes are a combination of."""
    coefficients: tuple[float, ...]
    """Bytes per unit of each term."""
    when: tuple[str, ...]
    """Literals (PREDICATES names, '!' negates) that must all hold for the event to happen."""
    unless: tuple[str, ...] = ()
    """Literals that, when all hold (and there is at least one), stop the event from happening."""

    def happens(self, z: Sizes) -> bool:
        """Whether the event is part of the window at sizes `z`."""
        return _holds(self.when, z) and not (self.unless and _holds(self.unless, z))

    def nbytes(self, z: Sizes) -> float:
        """Bytes at sizes `z` (positive)."""
        return float(sum(c * TRANSIENT_TERMS[t](z) for t, c in zip(self.terms, self.coefficients)))


@dataclass(frozen=True)
class PeakModel(JsonMixin):
    """A window's peak as a replay of its fitted events."""

    events: tuple[PeakEvent, ...]
    """The union sequence."""
    offset: tuple[PeakEvent, ...]
    """Added to the running maximum where they happen (the backward's received gradient)."""
    samples: int
    """Shapes it was fitted on."""
    max_abs_residual: float
    """Largest |replayed - measured| peak (or kept bytes) over the fitted shapes (bytes)."""
    loo_max_rel_error: float
    """Largest relative error predicting a left-out shape's peak (over loo_folds folds)."""
    loo_folds: int
    """Shapes left out in turn for loo_max_rel_error (evenly spread, at most LOO_FOLDS)."""
    inexact_events: int
    """Events whose bytes or presence no term combination / rule reproduces exactly."""
    kept: tuple[PeakEvent, ...] = ()
    """Added to the window's net allocation for the bytes kept after it (forward windows: the saved
    activations are the net forward minus the output the schedule frees, plus its placeholder)."""
    kept_loo_max_rel_error: float = 0.0
    """Largest error predicting a left-out shape's kept bytes (forward windows), relative to the larger
    of its kept bytes and its peak (a recomputed layer keeps a few bytes; its peak is the scale)."""

    def _run(self, z: Sizes) -> np.ndarray:
        return np.cumsum([(1.0 if e.op[0] == "+" else -1.0) * e.nbytes(z) for e in self.events if e.happens(z)])

    def predict(self, z: Sizes) -> float:
        """The window's peak at sizes `z`."""
        return max(0.0, float(self._run(z).max(initial=0.0))) + _total(self.offset, z)

    def kept_bytes(self, z: Sizes) -> float:
        """Bytes the window leaves allocated at sizes `z` (forward windows: the saved activations)."""
        run = self._run(z)
        return (float(run[-1]) if len(run) else 0.0) + _total(self.kept, z)


def _total(events: tuple[PeakEvent, ...], z: Sizes) -> float:
    return sum(e.nbytes(z) for e in events if e.happens(z))


def _running(line: Timeline) -> np.ndarray:
    """Bytes allocated within the window after each of its events."""
    return np.cumsum([n if op[0] == "+" else -n for op, n in zip(line.ops, line.nbytes)], dtype=np.int64)


def net_bytes(line: Timeline) -> int:
    """What a timeline leaves allocated."""
    run = _running(line)
    return int(run[-1]) if len(run) else 0


def measured_peak(line: Timeline) -> int:
    """The peak a timeline replays to (equals the record's peak field)."""
    return max(0, int(_running(line).max(initial=0))) + line.offset


@functools.lru_cache(maxsize=8)
def _combos(m: int, k: int) -> np.ndarray:
    return np.array(list(itertools.combinations(range(m), k)), dtype=np.int64)


def _preference(coef: np.ndarray) -> np.ndarray:
    """Lower is better: element sizes (1, 2, 4, 8 bytes per term unit) first."""
    nice = np.isin(np.round(np.abs(coef), 9), (1.0, 2.0, 4.0, 8.0))
    return (~nice).sum(axis=1)


def _exact(x: np.ndarray, y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The k-term combination reproducing y within half a byte (the most natural one), or None."""
    combos = _combos(x.shape[1], k)
    a = np.transpose(x[:, combos], (1, 0, 2))
    coef = np.einsum("pkn,n->pk", np.linalg.pinv(a), y)
    snapped = np.round(coef * SNAP) / SNAP
    for c in (snapped, coef):
        resid = np.abs(np.einsum("pnk,pk->pn", a, c) - y).max(axis=1)
        ok = np.flatnonzero((resid < 0.5) & np.all(np.abs(c) > 1e-9, axis=1))
        if ok.size:
            best = ok[np.argmin(_preference(c[ok]))]
            return combos[best], c[best]
    return None


def _fit_bytes(x: np.ndarray, y: np.ndarray) -> tuple[tuple[int, ...], tuple[float, ...], bool]:
    """Column indices, coefficients and exactness of the sparsest exact fit of y on x's columns."""
    if not np.any(y):
        return (), (), True
    for k in (1, 2, 3):
        if len(y) > k or k == 1:
            found = _exact(x, y, k)
            if found is not None:
                return tuple(int(i) for i in found[0]), tuple(float(c) for c in found[1]), True
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    keep = np.flatnonzero(np.abs(coef) > 1e-12)
    return tuple(int(i) for i in keep), tuple(float(coef[i]) for i in keep), False


def _literals(zs: list[Sizes]) -> tuple[list[str], np.ndarray]:
    names = [n for p in PREDICATES for n in (p, "!" + p)]
    table = np.array([[PREDICATES[n.lstrip("!")](z) != n.startswith("!") for n in names] for z in zs], dtype=bool)
    return names, table


def _rule(present: np.ndarray, names: list[str], table: np.ndarray) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """(when, unless, exact): the shortest conjunction of literals true exactly where the event
    happened, or else one true exactly where it did not."""
    if present.all():
        return (), (), True
    best, errors = ((), ()), int((~present).sum())
    for k in (1, 2):
        for combo in itertools.combinations(range(len(names)), k):
            hit = table[:, list(combo)].all(axis=1)
            literals = tuple(names[i] for i in combo)
            for wrong, rule in ((int((hit != present).sum()), (literals, ())),
                                (int((hit == present).sum()), ((), literals))):
                if wrong < errors:
                    best, errors = rule, wrong
        if errors == 0:
            break
    return best[0], best[1], errors == 0


def _fit_rows(values: dict[int, int], rows: list[int], x: np.ndarray):
    return _fit_bytes(x[rows], np.array([values[r] for r in rows], dtype=np.float64))


def _split(values: dict[int, int], x: np.ndarray, names: list[str], table: np.ndarray):
    """A literal on which the event's bytes follow one exact fit where it holds and another where not
    (the same op copying a different tensor: e.g. a transpose that is a view only when b = 1), with
    both fits; None when there is none (each side needs two shapes)."""
    rows = sorted(values)
    best, margin = None, 1
    for j, name in enumerate(names):
        if name.startswith("!"):
            continue
        sides = ([r for r in rows if table[r, j]], [r for r in rows if not table[r, j]])
        if min(len(sides[0]), len(sides[1])) <= margin:
            continue
        fits = [_fit_rows(values, side, x) for side in sides]
        if fits[0][2] and fits[1][2]:
            best, margin = (name, fits), min(len(sides[0]), len(sides[1]))
    return best


def _event(op: str, values: dict[int, int], x: np.ndarray, names: list[str], table: np.ndarray):
    """The PeakEvents (one, or two split on a literal) of one union position, and whether exact."""
    cols, coef, exact = _fit_rows(values, sorted(values), x)
    when, unless, known = _rule(_present(values, len(x)), names, table)
    split = None if exact else _split(values, x, names, table)
    if split is None:
        pieces = [((), cols, coef)]
    else:
        name, fits = split
        pieces = [((name,), fits[0][0], fits[0][1]), (("!" + name,), fits[1][0], fits[1][1])]
        exact = True
    events = tuple(PeakEvent(op=op, terms=tuple(TERM_NAMES[c] for c in c_cols), coefficients=c_coef,
                             when=when + extra, unless=unless) for extra, c_cols, c_coef in pieces)
    return events, exact and known


TERM_NAMES = tuple(TRANSIENT_TERMS)


def _design(zs: list[Sizes]) -> np.ndarray:
    return np.array([[TRANSIENT_TERMS[n](z) for n in TERM_NAMES] for z in zs], dtype=np.float64)


def _defer_releases(keys: list[str], samples: list[dict[int, int]], names: list[str], table: np.ndarray) -> None:
    """A release that comes at different places at different shapes, where no rule tells which shapes
    release it where, is moved to its latest place (releasing later never lowers a replayed peak)."""
    places = defaultdict(list)
    for pos, key in enumerate(keys):
        if key[0] == "-" and key[1:].isdigit() and samples[pos]:
            places[key].append(pos)
    for positions in places.values():
        if len(positions) > 1 and not all(_rule(_present(samples[p], len(table)), names, table)[2] for p in positions):
            for p in positions[:-1]:
                samples[positions[-1]].update(samples[p])
                samples[p] = {}


def _samples(size: int, lines: list[Timeline], maps: list[list[int]], keep=None) -> list[dict[int, int]]:
    """Per union position: {timeline index: bytes} of the events mapped there (those `keep(i, pos)`
    accepts, when given)."""
    samples: list[dict[int, int]] = [{} for _ in range(size)]
    for i, (line, where) in enumerate(zip(lines, maps)):
        for pos, nbytes in zip(where, line.nbytes):
            if keep is None or keep(i, pos):
                samples[pos][i] = nbytes
    return samples


def _present(values: dict[int, int], n: int) -> np.ndarray:
    present = np.zeros(n, dtype=bool)
    present[sorted(values)] = True
    return present


def _fit_events(zs: list[Sizes], lines: list[Timeline], aligned: tuple, kept: list[int] | None):
    """(events, offset events, kept events, inexact count) over the aligned timelines (union positions
    no timeline reaches are dropped)."""
    union, keys, maps = aligned
    x = _design(zs)
    names, table = _literals(zs)
    samples = _samples(len(union), lines, maps)
    _defer_releases(keys, samples, names, table)
    events, inexact = [], 0
    for op, values in zip(union, samples):
        if values:
            found, exact = _event(op, values, x, names, table)
            events += found
            inexact += not exact
    offset, exact = _event("+offset", {i: line.offset for i, line in enumerate(lines)}, x, names, table)
    kept_events = ()
    if kept is not None:
        kept_events, _ = _event("+kept", {i: k - net_bytes(line) for i, (k, line) in enumerate(zip(kept, lines))},
                                x, names, table)
    return tuple(events), offset, kept_events, inexact + (not exact)


def _loo(zs: list[Sizes], lines: list[Timeline], aligned: tuple, kept: list[int] | None) -> tuple[float, float, int]:
    """(peak, kept) largest leave-one-out relative errors and the number of folds."""
    if len(zs) <= 3:
        return 0.0, 0.0, 0
    folds = sorted(set(np.linspace(0, len(zs) - 1, min(LOO_FOLDS, len(zs))).round().astype(int).tolist()))
    worst = [0.0, 0.0]
    for i in folds:
        keep = [j for j in range(len(zs)) if j != i]
        subset = (aligned[0], aligned[1], [aligned[2][j] for j in keep])
        ev, off, kev, _ = _fit_events([zs[j] for j in keep], [lines[j] for j in keep], subset,
                                      None if kept is None else [kept[j] for j in keep])
        model = PeakModel(ev, off, len(keep), 0.0, 0.0, 0, 0, kev)
        peak = measured_peak(lines[i])
        worst[0] = max(worst[0], abs(model.predict(zs[i]) - peak) / max(peak, 1.0))
        if kept is not None:
            worst[1] = max(worst[1], abs(model.kept_bytes(zs[i]) - kept[i]) / max(kept[i], peak, 1.0))
    return worst[0], worst[1], len(folds)


def fit_peak(zs: list[Sizes], lines: list[Timeline], kept: list[int] | None = None,
             aligned: tuple | None = None) -> PeakModel:
    """Fit one window's peak over shapes `zs` from their timelines (and, given the bytes each shape
    keeps after the window, the kept bytes), on `aligned` (peak_align.align) or their own alignment.
    Leave-one-out refits the events without the left-out shape on the alignment of all shapes
    (aligning is structure, not sizes)."""
    aligned = aligned or align(zs, lines)
    events, offset, kept_events, inexact = _fit_events(zs, lines, aligned, kept)
    model = PeakModel(events, offset, len(zs), 0.0, 0.0, 0, inexact, kept_events)
    resid = max(abs(model.predict(z) - measured_peak(line)) for z, line in zip(zs, lines))
    if kept is not None:
        resid = max(resid, max(abs(model.kept_bytes(z) - k) for z, k in zip(zs, kept)))
    peak_loo, kept_loo, folds = _loo(zs, lines, aligned, kept)
    return PeakModel(events, offset, len(zs), float(resid), peak_loo, folds, inexact, kept_events, kept_loo)


def kept_events(zs: list[Sizes], lines: list[Timeline]) -> tuple[PeakEvent, ...]:
    """The allocations of a window left unreleased at its end, each fitted on the size terms with the
    rule of the shapes at which it is kept: for a forward window, the tensors it leaves for backward
    (and its output), one by one."""
    union, keys, maps = align(zs, lines)
    x = _design(zs)
    names, table = _literals(zs)
    present = [{keys[p] for p in where} for where in maps]
    samples = _samples(len(union), lines, maps,
                       lambda i, pos: keys[pos][0] == "+" and "-" + keys[pos][1:] not in present[i])
    out: list[PeakEvent] = []
    for op, values in zip(union, samples):
        if values:
            out += _event(op, values, x, names, table)[0]
    return tuple(out)
