"""Least-squares regression of one memory quantity on named terms, with leave-one-out error.

Terms that the probes cannot tell apart (collinear columns) are dropped by QR with column pivoting,
so every kept coefficient is identified. Coefficients are then snapped to multiples of 1/64 when
that does not worsen the fit: byte counts are integer combinations of the terms, and snapping turns
4.0000001 into 4 so predictions of unseen shapes stay exact. Pure numpy/scipy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capture_megatron.fit.terms import TERM_SETS, Sizes
from capture_megatron.serial import JsonMixin

SNAP = 64.0


@dataclass(frozen=True)
class Regression(JsonMixin):
    """A fitted linear model y = sum(coefficient * term(sizes))."""

    term_set: str
    """Which vocabulary the terms come from (activation, parameter, step)."""
    terms: tuple[str, ...]
    """Names of the kept terms."""
    coefficients: tuple[float, ...]
    """One coefficient per kept term."""
    max_abs_residual: float
    """Largest |measured - fitted| over the probes (bytes or elements)."""
    loo_max_rel_error: float
    """Largest relative error predicting a probe left out of the fit (0 when too few probes)."""
    samples: int
    """Probes the fit used."""

    def predict(self, z: Sizes) -> float:
        """The fitted value at sizes `z`."""
        table = TERM_SETS[self.term_set]
        return float(sum(c * table[name](z) for name, c in zip(self.terms, self.coefficients)))


def _design(term_set: str, sizes: list[Sizes]) -> tuple[list[str], np.ndarray]:
    table = TERM_SETS[term_set]
    names = list(table)
    return names, np.array([[table[n](z) for n in names] for z in sizes], dtype=np.float64)


def _independent(names: list[str], x: np.ndarray) -> list[int]:
    """Indices of columns QR with pivoting finds independent (scaled so units don't matter)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    import scipy.linalg  # 0.2 s of import, needed only to fit (a warm plan reads its fit)

    _, r, piv = scipy.linalg.qr(xs, mode="economic", pivoting=True)
    diag = np.abs(np.diag(r))
    if diag.size == 0 or diag[0] == 0:
        return []
    keep = [int(piv[i]) for i in range(diag.size) if diag[i] > 1e-9 * diag[0]]
    return sorted(keep)


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    snapped = np.round(coef * SNAP) / SNAP
    tol = max(1e-9 * float(np.abs(y).max(initial=1.0)), 1e-6)
    if np.abs(x @ snapped - y).max(initial=0.0) <= np.abs(x @ coef - y).max(initial=0.0) + tol:
        return snapped
    return coef


def _loo(x: np.ndarray, y: np.ndarray) -> float:
    n, m = x.shape
    if n <= m + 1:
        return 0.0
    worst = 0.0
    for i in range(n):
        mask = np.arange(n) != i
        coef = _solve(x[mask], y[mask])
        pred = float(x[i] @ coef)
        worst = max(worst, abs(pred - y[i]) / max(abs(y[i]), 1.0))
    return worst


def regress(term_set: str, sizes: list[Sizes], values: list[float]) -> Regression:
    """Fit `values` measured at `sizes` on the identifiable terms of `term_set`."""
    names, x_all = _design(term_set, sizes)
    y = np.asarray(values, dtype=np.float64)
    keep = _independent(names, x_all)
    if not keep or not np.any(y):
        return Regression(term_set, (), (), float(np.abs(y).max(initial=0.0)), 0.0, len(values))
    x = x_all[:, keep]
    coef = _solve(x, y)
    resid = float(np.abs(x @ coef - y).max(initial=0.0))
    return Regression(
        term_set,
        tuple(names[i] for i in keep),
        tuple(float(c) for c in coef),
        resid,
        _loo(x, y),
        len(values),
    )
