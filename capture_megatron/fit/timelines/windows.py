"""Replayed timelines per probe window: fit them (capture_megatron.fit.timelines.peaks) and look
up any window's replayed peak or kept bytes at any shape (the fit's constants are read off them by
capture_megatron.fit.model).

Each probe (chunk kind, layers, recomputed layers) has a forward, a backward and (cpu) an optimizer
step window. The forward's model also gives the bytes the forward keeps: the saved activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from capture_megatron.fit.terms import Sizes
from capture_megatron.fit.timelines.align import align
from capture_megatron.fit.timelines.events import PeakModel
from capture_megatron.fit.timelines.peaks import fit_peak
from capture_megatron.records import ProfileRecord
from capture_megatron.serial import JsonMixin

MIN_SHAPES = 4
"""Fewer probed shapes than this: no timeline models (the regressions alone)."""
WINDOWS = ("forward", "backward", "step")
"""The measured windows of a probe."""
KEPT = "kept"
"""Pseudo-window: the bytes the forward keeps."""
FIELDS = {
    "saved1": (1, 0, KEPT),
    "saved0": (0, 0, KEPT),
    "fwd1": (1, 0, "forward"),
    "bwd1": (1, 0, "backward"),
    "step1": (1, 0, "step"),
    "fwd0": (0, 0, "forward"),
    "bwd0": (0, 0, "backward"),
    "step0": (0, 0, "step"),
    "fwdrc": (1, 1, "forward"),
    "bwdrc": (1, 1, "backward"),
    "bwdmix": (2, 1, "backward"),
}
"""KindConstants field -> (layers, recomputed layers, window) of the probe it is read from."""
LAYER_FIELDS = {
    "layer_saved": ((2, 0), (1, 0)),
    "layer_saved_rc": ((2, 1), (1, 0)),
    "layer_saved_rc_next": ((2, 2), (1, 1)),
}
"""ShapeConstants field -> the two middle probes whose kept bytes it is the difference of."""


@dataclass(frozen=True)
class ProbeWindow(JsonMixin):
    """The replayed model of one window of one probe, across shapes."""

    kind: str
    """Chunk kind (first, middle, last, only)."""
    layers: int
    """Transformer layers of the probe."""
    recompute_layers: int
    """Of which fully recomputed."""
    window: str
    """forward, backward or step."""
    model: PeakModel
    """The fitted events (forward windows also model the kept bytes)."""


ProbeKey = tuple[str, int, int]
"""(chunk kind, layers, recomputed layers) of a probe."""
Lookup = Callable[[str, int, int, str], "float | None"]
"""value(kind, layers, recomputed, window): a window's replayed peak (or KEPT bytes), if
modelled."""


def fit_windows(
    zs: list[Sizes], tables: list[dict[ProbeKey, ProfileRecord]]
) -> tuple[ProbeWindow, ...]:
    """Fit every probe window that carries a timeline at every shape ({(kind, layers, recomputed):
    record} per shape, in the order of `zs`)."""
    if len(tables) < MIN_SHAPES:
        return ()
    out = []
    for key in sorted(tables[0]):
        found = [t.get(key) for t in tables]
        records = [r for r in found if r is not None]
        if len(records) < len(found):
            continue
        before = None
        for window in WINDOWS:
            maybe = [r.timeline(window) for r in records]
            lines = [line for line in maybe if line is not None]
            if len(lines) < len(maybe):
                before = None
                continue
            aligned = align(zs, lines, before)
            kept = [r.saved_bytes for r in records] if window == "forward" else None
            kind, layers, rc = key
            out.append(ProbeWindow(kind, layers, rc, window, fit_peak(zs, lines, kept, aligned)))
            before = aligned[2]
    return tuple(out)


def lookup(windows: tuple[ProbeWindow, ...], z: Sizes) -> Lookup:
    """The replayed value of any modelled window at sizes `z` (see Lookup)."""
    table = {(w.kind, w.layers, w.recompute_layers, w.window): w.model for w in windows}

    def value(kind: str, layers: int, rc: int, window: str) -> float | None:
        model = table.get((kind, layers, rc, "forward" if window == KEPT else window))
        if model is None:
            return None
        return model.kept_bytes(z) if window == KEPT else model.predict(z)

    return value
