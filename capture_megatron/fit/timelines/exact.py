"""Exact fits of one union position of aligned timelines: its bytes as the sparsest combination of
size terms (terms.TRANSIENT_TERMS: 1, then 2, then 3 terms; split on one shape condition when no
single formula fits; least squares only when nothing is exact), and when it happens at all (the
shortest conjunction of at most two literals over events.PREDICATES). Pure Python + numpy.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from capture_megatron.fit.terms import TRANSIENT_TERMS, Sizes
from capture_megatron.fit.timelines.events import PREDICATES, PeakEvent

SNAP = 64.0
"""Exact coefficients are looked for on a grid of 1/SNAP bytes per term unit."""


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


def fit_bytes(x: np.ndarray, y: np.ndarray) -> tuple[tuple[int, ...], tuple[float, ...], bool]:
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


def literals(zs: list[Sizes]) -> tuple[list[str], np.ndarray]:
    """Every literal (PREDICATES and their negations) and its truth at each shape."""
    names = [n for p in PREDICATES for n in (p, "!" + p)]
    table = np.array(
        [[PREDICATES[n.lstrip("!")](z) != n.startswith("!") for n in names] for z in zs], dtype=bool
    )
    return names, table


def presence_rule(
    present: np.ndarray, names: list[str], table: np.ndarray
) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """(when, unless, exact): the shortest conjunction of literals true exactly where the event
    happened, or else one true exactly where it did not."""
    if present.all():
        return (), (), True
    best: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    errors = int((~present).sum())
    for k in (1, 2):
        for combo in itertools.combinations(range(len(names)), k):
            hit = table[:, list(combo)].all(axis=1)
            literals = tuple(names[i] for i in combo)
            for wrong, rule in (
                (int((hit != present).sum()), (literals, ())),
                (int((hit == present).sum()), ((), literals)),
            ):
                if wrong < errors:
                    best, errors = rule, wrong
        if errors == 0:
            break
    return best[0], best[1], errors == 0


Fit = tuple[tuple[int, ...], tuple[float, ...], bool]
"""Column indices, coefficients and exactness of one event's bytes fit."""


def fit_rows(values: dict[int, int], rows: list[int], x: np.ndarray) -> Fit:
    """fit_bytes of the bytes `values` holds at the shapes `rows`."""
    return fit_bytes(x[rows], np.array([values[r] for r in rows], dtype=np.float64))


def _split(
    values: dict[int, int], x: np.ndarray, names: list[str], table: np.ndarray
) -> tuple[str, list[Fit]] | None:
    """A literal on which the event's bytes follow one exact fit where it holds and another where
    not (the same op copying a different tensor: e.g. a transpose that is a view only when b = 1),
    with both fits; None when there is none (each side needs two shapes)."""
    rows = sorted(values)
    best: tuple[str, list[Fit]] | None = None
    margin = 1
    for j, name in enumerate(names):
        if name.startswith("!"):
            continue
        sides = ([r for r in rows if table[r, j]], [r for r in rows if not table[r, j]])
        if min(len(sides[0]), len(sides[1])) <= margin:
            continue
        fits = [fit_rows(values, side, x) for side in sides]
        if fits[0][2] and fits[1][2]:
            best, margin = (name, fits), min(len(sides[0]), len(sides[1]))
    return best


def fit_event(
    op: str, values: dict[int, int], x: np.ndarray, names: list[str], table: np.ndarray
) -> tuple[tuple[PeakEvent, ...], bool]:
    """The PeakEvents (one, or two split on a literal) of one union position, and whether exact."""
    cols, coef, exact = fit_rows(values, sorted(values), x)
    when, unless, known = presence_rule(present(values, len(x)), names, table)
    split = None if exact else _split(values, x, names, table)
    pieces: list[tuple[tuple[str, ...], tuple[int, ...], tuple[float, ...]]]
    if split is None:
        pieces = [((), cols, coef)]
    else:
        name, fits = split
        pieces = [((name,), fits[0][0], fits[0][1]), (("!" + name,), fits[1][0], fits[1][1])]
        exact = True
    events = tuple(
        PeakEvent(
            op=op,
            terms=tuple(TERM_NAMES[c] for c in c_cols),
            coefficients=c_coef,
            when=when + extra,
            unless=unless,
        )
        for extra, c_cols, c_coef in pieces
    )
    return events, exact and known


TERM_NAMES = tuple(TRANSIENT_TERMS)
"""The term names, in design-matrix column order."""


def design(zs: list[Sizes]) -> np.ndarray:
    """Every transient term (TERM_NAMES) at every shape."""
    return np.array([[TRANSIENT_TERMS[n](z) for n in TERM_NAMES] for z in zs], dtype=np.float64)


def present(values: dict[int, int], n: int) -> np.ndarray:
    """Which of `n` shapes the event was seen at (the keys of `values`)."""
    present = np.zeros(n, dtype=bool)
    present[sorted(values)] = True
    return present
