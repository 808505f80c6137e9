"""Replayed timelines per probe window: fit them (capture_megatron.fit.timelines.events) and read the decomposition
constants of capture_megatron.fit off them at any shape.

Each probe (chunk kind, layers, recomputed layers) has a forward, a backward and (cpu) an optimizer
step window. The forward's model also gives the bytes the forward keeps: the saved activations.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from capture_megatron.fit.timelines.align import align
from capture_megatron.fit.timelines.events import PeakModel, fit_peak
from capture_megatron.serial import JsonMixin
from capture_megatron.fit.terms import Sizes

MIN_SHAPES = 4
"""Fewer probed shapes than this: no timeline models (the regressions alone)."""
WINDOWS = ("forward", "backward", "step")
KEPT = "kept"
"""Pseudo-window: the bytes the forward keeps."""
FIELDS = {"saved1": (1, 0, KEPT), "saved0": (0, 0, KEPT), "fwd1": (1, 0, "forward"), "bwd1": (1, 0, "backward"),
          "step1": (1, 0, "step"), "fwd0": (0, 0, "forward"), "bwd0": (0, 0, "backward"), "step0": (0, 0, "step"),
          "fwdrc": (1, 1, "forward"), "bwdrc": (1, 1, "backward"), "bwdmix": (2, 1, "backward")}
"""KindConstants field -> (layers, recomputed layers, window) of the probe it is read from."""
LAYER_FIELDS = {"layer_saved": ((2, 0), (1, 0)), "layer_saved_rc": ((2, 1), (1, 0)),
                "layer_saved_rc_next": ((2, 2), (1, 1))}
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


def fit_windows(zs: list[Sizes], tables: list[dict]) -> tuple[ProbeWindow, ...]:
    """Fit every probe window that carries a timeline at every shape ({(kind, layers, recomputed):
    record} per shape, in the order of `zs`)."""
    if len(tables) < MIN_SHAPES:
        return ()
    out = []
    for key in sorted(tables[0]):
        records = [t.get(key) for t in tables]
        if any(r is None for r in records):
            continue
        before = None
        for window in WINDOWS:
            lines = [r.timeline(window) for r in records]
            if any(line is None for line in lines):
                before = None
                continue
            aligned = align(zs, lines, before)
            kept = [r.saved_bytes for r in records] if window == "forward" else None
            out.append(ProbeWindow(*key, window, fit_peak(zs, lines, kept, aligned)))
            before = aligned[2]
    return tuple(out)


def _lookup(windows: tuple[ProbeWindow, ...], z: Sizes):
    table = {(w.kind, w.layers, w.recompute_layers, w.window): w.model for w in windows}

    def value(kind: str, layers: int, rc: int, window: str) -> float | None:
        model = table.get((kind, layers, rc, "forward" if window == KEPT else window))
        if model is None:
            return None
        return model.kept_bytes(z) if window == KEPT else model.predict(z)
    return value


def replayed(sc, windows: tuple[ProbeWindow, ...]):
    """ShapeConstants `sc` (regressed) with every constant the windows model replaced by its replay."""
    value = _lookup(windows, sc.sizes)
    chunks = []
    for c in sc.chunks:
        found = {name: value(c.kind, *where) for name, where in FIELDS.items() if getattr(c, name) is not None}
        chunks.append(dataclasses.replace(c, **{k: v for k, v in found.items() if v is not None}))
    layer = {}
    for name, (plus, minus) in LAYER_FIELDS.items():
        a, b = value("middle", *plus, KEPT), value("middle", *minus, KEPT)
        if getattr(sc, name) is not None and a is not None and b is not None:
            layer[name] = a - b
    return dataclasses.replace(sc, chunks=tuple(chunks), **layer)
