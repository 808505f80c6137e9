"""The replayed-timeline peak model on hand-written timelines
(capture_megatron.fit.timelines.events, peak_align)."""

from __future__ import annotations

from capture_megatron.fit.terms import Sizes
from capture_megatron.fit.timelines.align import align
from capture_megatron.fit.timelines.events import measured_peak
from capture_megatron.fit.timelines.peaks import fit_peak
from capture_megatron.records import Timeline

SHAPES = [
    Sizes(b=b, s=s, h=h, a=4, g=g, d=h // 4, f=4 * h, V=512, t=t)
    for b, s, h, g, t in (
        (1, 64, 32, 2, 2),
        (2, 32, 64, 4, 2),
        (3, 16, 32, 2, 1),
        (1, 128, 64, 4, 4),
        (2, 64, 96, 2, 2),
        (4, 32, 32, 4, 4),
        (1, 16, 128, 2, 1),
    )
]


def _timeline(z: Sizes) -> Timeline:
    """A window in the style of a bf16 layer: a transpose that is a copy only when b > 1 (a clone of
    the whole activation), then a chunk clone, a matmul output, releases in allocation order."""
    events = []  # (op, bytes, index of the allocation it releases or -1)
    if z.b > 1:
        events.append(("+clone", 2 * z.b * z.s * z.h, -1))
    chunk = len(events)
    events.append(("+clone", 2 * z.b * z.s * z.h // z.t, -1))
    events.append(("+mm", 2 * z.b * z.s * z.f // z.t, -1))
    if z.b > 1:
        events.append(("-clone", 2 * z.b * z.s * z.h, 0))
    events.append(("-clone", 2 * z.b * z.s * z.h // z.t, chunk))
    events.append(("+gelu", 2 * z.b * z.s * z.f // z.t, -1))
    ops, nbytes, origins = zip(*events)
    return Timeline("forward", ops, nbytes, 0, origins)


def test_aligns_by_size_terms_not_by_op_name_alone():
    lines = [_timeline(z) for z in SHAPES]
    names, _, maps = align(SHAPES, lines)
    assert names.count("+clone") == 2
    one = SHAPES.index(next(z for z in SHAPES if z.b == 1))
    many = SHAPES.index(next(z for z in SHAPES if z.b > 1))
    # the b = 1 window's only clone is the chunk clone: it must sit where the b > 1 window's second
    # one does
    assert maps[one][0] == maps[many][1]


def test_replay_predicts_unseen_shapes_exactly():
    model = fit_peak(SHAPES, [_timeline(z) for z in SHAPES])
    assert (
        model.max_abs_residual == 0 and model.inexact_events == 0 and model.loo_max_rel_error == 0
    )
    for z in (
        Sizes(b=5, s=48, h=80, a=4, g=2, d=20, f=320, V=512, t=2),
        Sizes(b=1, s=256, h=48, a=4, g=4, d=12, f=192, V=512, t=4),
    ):
        assert model.predict(z) == measured_peak(_timeline(z)), z
