"""Transient peaks and saved bytes across shapes, by replaying allocation timelines (numpy).

A forward, backward or optimizer step's peak is the maximum of a running sum of allocations and
releases. Which temporaries coexist at the maximum changes with the shape, so one linear regression
of the peak cannot follow it (leave-one-out errors of 20-860%). Each single allocation, though, is
one tensor whose bytes are a product of sizes times the element size. So the profiler records every
window's events in order (records.Timeline), and this module

1. aligns the event sequences of all probed shapes into one union sequence (align: the same op
   and the same multiple of a size term; a release matched through its allocation),
2. fits each event's bytes exactly on the fewest terms of terms.TRANSIENT_TERMS (1, then 2, then 3;
   split on one shape condition when no single formula fits; least squares only when nothing is
   exact),
3. learns when an event happens at all: some only exist for some shapes (a reshape is a view when
   one sequence or one head per rank makes it contiguous, a copy otherwise), described by a
   conjunction (or a negated one) of at most two literals over events.PREDICATES (steps 2 and 3:
   exact),
4. predicts a shape's peak by replaying the events that happen at that shape with their fitted
   bytes, and what the window leaves allocated (a forward's saved activations) from the same events.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from capture_megatron.fit.terms import Sizes
from capture_megatron.fit.timelines.align import Alignment, align
from capture_megatron.fit.timelines.events import PeakEvent, PeakModel, measured_peak, net_bytes
from capture_megatron.fit.timelines.exact import design, fit_event, literals, presence_rule, present
from capture_megatron.records import Timeline

LOO_FOLDS = 8
"""Shapes left out in turn for the leave-one-out error (evenly spread)."""


def _defer_releases(
    keys: list[str], samples: list[dict[int, int]], names: list[str], table: np.ndarray
) -> None:
    """A release that comes at different places at different shapes, where no rule tells which
    shapes release it where, is moved to its latest place (releasing later never lowers a replayed
    peak)."""
    places = defaultdict(list)
    for pos, key in enumerate(keys):
        if key[0] == "-" and key[1:].isdigit() and samples[pos]:
            places[key].append(pos)
    for positions in places.values():
        if len(positions) > 1 and not all(
            presence_rule(present(samples[p], len(table)), names, table)[2] for p in positions
        ):
            for p in positions[:-1]:
                samples[positions[-1]].update(samples[p])
                samples[p] = {}


def _samples(
    size: int,
    lines: list[Timeline],
    maps: list[list[int]],
    keep: Callable[[int, int], bool] | None = None,
) -> list[dict[int, int]]:
    """Per union position: {timeline index: bytes} of the events mapped there (those `keep(i, pos)`
    accepts, when given)."""
    samples: list[dict[int, int]] = [{} for _ in range(size)]
    for i, (line, where) in enumerate(zip(lines, maps)):
        for pos, nbytes in zip(where, line.nbytes):
            if keep is None or keep(i, pos):
                samples[pos][i] = nbytes
    return samples


Events = tuple[PeakEvent, ...]
"""A sequence of fitted events."""


def _fit_events(
    zs: list[Sizes], lines: list[Timeline], aligned: Alignment, kept: list[int] | None
) -> tuple[Events, Events, Events, int]:
    """(events, offset events, kept events, inexact count) over the aligned timelines (union
    positions no timeline reaches are dropped)."""
    union, keys, maps = aligned
    x = design(zs)
    names, table = literals(zs)
    samples = _samples(len(union), lines, maps)
    _defer_releases(keys, samples, names, table)
    events: list[PeakEvent] = []
    inexact = 0
    for op, values in zip(union, samples):
        if values:
            found, exact = fit_event(op, values, x, names, table)
            events += found
            inexact += not exact
    offset, exact = fit_event(
        "+offset", {i: line.offset for i, line in enumerate(lines)}, x, names, table
    )
    kept_events: Events = ()
    if kept is not None:
        kept_events, _ = fit_event(
            "+kept",
            {i: k - net_bytes(line) for i, (k, line) in enumerate(zip(kept, lines))},
            x,
            names,
            table,
        )
    return tuple(events), offset, kept_events, inexact + (not exact)


def _loo(
    zs: list[Sizes], lines: list[Timeline], aligned: Alignment, kept: list[int] | None
) -> tuple[float, float, int]:
    """(peak, kept) largest leave-one-out relative errors and the number of folds."""
    if len(zs) <= 3:
        return 0.0, 0.0, 0
    folds = sorted(
        set(np.linspace(0, len(zs) - 1, min(LOO_FOLDS, len(zs))).round().astype(int).tolist())
    )
    worst = [0.0, 0.0]
    for i in folds:
        keep = [j for j in range(len(zs)) if j != i]
        subset = (aligned[0], aligned[1], [aligned[2][j] for j in keep])
        ev, off, kev, _ = _fit_events(
            [zs[j] for j in keep],
            [lines[j] for j in keep],
            subset,
            None if kept is None else [kept[j] for j in keep],
        )
        model = PeakModel(ev, off, len(keep), 0.0, 0.0, 0, 0, kev)
        peak = measured_peak(lines[i])
        worst[0] = max(worst[0], abs(model.predict(zs[i]) - peak) / max(peak, 1.0))
        if kept is not None:
            worst[1] = max(
                worst[1], abs(model.kept_bytes(zs[i]) - kept[i]) / max(kept[i], peak, 1.0)
            )
    return worst[0], worst[1], len(folds)


def fit_peak(
    zs: list[Sizes],
    lines: list[Timeline],
    kept: list[int] | None = None,
    aligned: Alignment | None = None,
) -> PeakModel:
    """Fit one window's peak over shapes `zs` from their timelines (and, given the bytes each shape
    keeps after the window, the kept bytes), on `aligned` (align.align) or their own alignment.
    Leave-one-out refits the events without the left-out shape on the alignment of all shapes
    (aligning is structure, not sizes)."""
    aligned = aligned or align(zs, lines)
    events, offset, kept_events, inexact = _fit_events(zs, lines, aligned, kept)
    model = PeakModel(events, offset, len(zs), 0.0, 0.0, 0, inexact, kept_events)
    resid = max(abs(model.predict(z) - measured_peak(line)) for z, line in zip(zs, lines))
    if kept is not None:
        resid = max(resid, max(abs(model.kept_bytes(z) - k) for z, k in zip(zs, kept)))
    peak_loo, kept_loo, folds = _loo(zs, lines, aligned, kept)
    return PeakModel(
        events, offset, len(zs), float(resid), peak_loo, folds, inexact, kept_events, kept_loo
    )


def kept_events(zs: list[Sizes], lines: list[Timeline]) -> tuple[PeakEvent, ...]:
    """The allocations of a window left unreleased at its end, each fitted on the size terms with
    the rule of the shapes at which it is kept: for a forward window, the tensors it leaves for
    backward (and its output), one by one."""
    union, keys, maps = align(zs, lines)
    x = design(zs)
    names, table = literals(zs)
    present = [{keys[p] for p in where} for where in maps]
    samples = _samples(
        len(union),
        lines,
        maps,
        lambda i, pos: keys[pos][0] == "+" and "-" + keys[pos][1:] not in present[i],
    )
    out: list[PeakEvent] = []
    for op, values in zip(union, samples):
        if values:
            out += fit_event(op, values, x, names, table)[0]
    return tuple(out)
