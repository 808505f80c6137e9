"""The fitted events of a window (PeakEvent) and its replay (PeakModel): a forward, backward or
optimizer step's peak is the maximum of a running sum of allocations and releases; each event is one
tensor whose bytes are a product of sizes times the element size, happening only under the shape
conditions it was seen under (PREDICATES). See capture_megatron.fit.timelines.peaks for how the
events are fitted. Pure Python + numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capture_megatron.fit.terms import TRANSIENT_TERMS, Sizes
from capture_megatron.records import Timeline
from capture_megatron.serial import JsonMixin

PREDICATES = {
    "b=1": lambda z: z.b == 1,
    "t=1": lambda z: z.t == 1,
    "g=a": lambda z: z.g == z.a,
    "g=t": lambda z: z.g == z.t,
    "a=t": lambda z: z.a == z.t,
    "b=1&g=t": lambda z: z.b == 1 and z.g == z.t,
    "b=1&a=t": lambda z: z.b == 1 and z.a == z.t,
}
"""Shape conditions under which torch takes a different path (view instead of copy, no
collective)."""


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
    """Largest error predicting a left-out shape's kept bytes (forward windows), relative to the
    larger of its kept bytes and its peak (a recomputed layer keeps a few bytes; its peak is the
    scale)."""

    def _run(self, z: Sizes) -> np.ndarray:
        return np.cumsum(
            [(1.0 if e.op[0] == "+" else -1.0) * e.nbytes(z) for e in self.events if e.happens(z)]
        )

    def predict(self, z: Sizes) -> float:
        """The window's peak at sizes `z`."""
        return max(0.0, float(self._run(z).max(initial=0.0))) + _total(self.offset, z)

    def kept_bytes(self, z: Sizes) -> float:
        """Bytes the window leaves allocated at sizes `z` (forward windows: the saved
        activations)."""
        run = self._run(z)
        return (float(run[-1]) if len(run) else 0.0) + _total(self.kept, z)


def _total(events: tuple[PeakEvent, ...], z: Sizes) -> float:
    return sum(e.nbytes(z) for e in events if e.happens(z))


def _running(line: Timeline) -> np.ndarray:
    """Bytes allocated within the window after each of its events."""
    return np.cumsum(
        [n if op[0] == "+" else -n for op, n in zip(line.ops, line.nbytes)], dtype=np.int64
    )


def net_bytes(line: Timeline) -> int:
    """What a timeline leaves allocated."""
    run = _running(line)
    return int(run[-1]) if len(run) else 0


def measured_peak(line: Timeline) -> int:
    """The peak a timeline replays to (equals the record's peak field)."""
    return max(0, int(_running(line).max(initial=0))) + line.offset
