"""Which probes to run: the model's own shapes (anchors) and a small fixed set of design shapes on
which every regression term is identifiable (torch-free).

The number of probes depends on the number of terms (and variants), never on the model's depth: per
shape, 8 chunk probes (17 with full recompute, 8 of them the no-recompute variant's chunks:
built_as); DESIGN_SHAPES shapes per variant, chosen deterministically so that the activation and
parameter design matrices have full column rank (checked). mCAP, by contrast, needs about one
profiling run per layer of the real model."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from capture_megatron.config import ModelShape
from capture_megatron.config.parallel import tp_fits
from capture_megatron.fit import shape_sizes
from capture_megatron.fit.terms import ACTIVATION_TERMS, PARAMETER_TERMS
from capture_megatron.records import Probe, ProbeShape, Variant

DESIGN_SHAPES = 24
BASE_PROBES = (
    ("middle", 1, 0),
    ("middle", 2, 0),
    ("first", 0, 0),
    ("first", 1, 0),
    ("last", 0, 0),
    ("last", 1, 0),
    ("only", 0, 0),
    ("only", 1, 0),
)
RECOMPUTE_PROBES = (
    ("middle", 1, 1),
    ("middle", 2, 1),
    ("middle", 2, 2),
    ("first", 1, 1),
    ("first", 2, 1),
    ("last", 1, 1),
    ("last", 2, 1),
    ("only", 1, 1),
    ("only", 2, 1),
)

MOE_RECOMPUTE_PROBES = (
    ("first", 2, 2),
    ("last", 2, 2),
    ("only", 2, 2),
)
"""MoE layers under full recompute: the backward of two recomputed layers of every kind (each
further recomputed layer adds the gradient it retains, capture_megatron.forecast.retained)."""


def _candidate(rng: random.Random, tps: tuple[int, ...]) -> ProbeShape:
    t = rng.choice(tps)
    a = t * rng.choice((1, 2, 3, 4, 4, 6)) if t > 1 else rng.choice((2, 3, 4, 6))
    groups = [x for x in range(t, a + 1, t) if a % x == 0]
    between = [x for x in groups if x not in (t, a)]
    # torch takes other paths when a rank holds one query group (g = t) or all heads have their own
    # (g = a, no expansion): each case, and GQA between them, is drawn often enough to be learned
    g = rng.choice(rng.choice([[t], [a]] + [between] * 2 if between else [[t], [a]]))
    return ProbeShape(
        micro_batch_size=rng.choice((1, 1, 2, 3)),
        seq_length=16 * t * rng.choice((1, 2, 3, 4, 6)),
        hidden_size=16 * rng.choice((2, 3, 4, 6, 8)),
        num_attention_heads=a,
        num_query_groups=g,
        kv_channels=8 * rng.choice((1, 2, 3, 4)),
        ffn_hidden_size=16 * t * rng.choice((2, 3, 5, 8)),
        padded_vocab=128 * t * rng.choice((1, 2, 3)),
        tp=t,
    )


def _full_rank(shapes: list[ProbeShape]) -> bool:
    zs = [shape_sizes(p) for p in shapes]
    for table in (ACTIVATION_TERMS, PARAMETER_TERMS):
        x = np.array([[fn(z) for fn in table.values()] for z in zs])
        x = x / np.maximum(np.abs(x).max(axis=0), 1e-30)
        if np.linalg.matrix_rank(x, tol=1e-9) < len(table):
            return False
    return True


def design_shapes(
    tps: tuple[int, ...], count: int = DESIGN_SHAPES, seed: int = 0
) -> list[ProbeShape]:
    """`count` probe shapes over TP sizes `tps`, all terms identifiable (deterministic)."""
    rng = random.Random(seed)
    shapes: list[ProbeShape] = []
    while len(shapes) < count or not _full_rank(shapes):
        cand = _candidate(rng, tps)
        if cand not in shapes:
            shapes.append(cand)
    return shapes


def probes_for(variant: Variant, shapes: list[ProbeShape]) -> list[Probe]:
    """The chunk probes of a variant on the given shapes."""
    full = variant.recompute == "full"
    keys = BASE_PROBES + (RECOMPUTE_PROBES if full else ())
    keys += MOE_RECOMPUTE_PROBES if full and variant.moe is not None else ()
    return [
        Probe(variant, shape, kind, layers, rc) for shape in shapes for kind, layers, rc in keys
    ]


def built_as(probe: Probe) -> Probe:
    """The probe that builds and runs the same chunk as `probe`: full recompute of none of its
    layers is megatron-core's model without recompute (the builder sets no recompute
    granularity), so such a probe is measured once, as the variant without recompute."""
    if probe.variant.recompute == "full" and probe.recompute_layers == 0:
        return dataclasses.replace(
            probe, variant=dataclasses.replace(probe.variant, recompute="none")
        )
    return probe


def variant_tps(variant: Variant, max_tp: int) -> tuple[int, ...]:
    """TP sizes to probe: 1, 2, 4 (up to max_tp); sequence parallelism needs TP > 1."""
    tps = tuple(t for t in (1, 2, 4) if t <= max(max_tp, 2))
    return tuple(t for t in tps if t > 1) if variant.sequence_parallel else tps


def model_probes(
    shape: ModelShape,
    variants: list[Variant],
    tps: list[int],
    micro_batch_sizes: list[int],
    design: bool,
) -> list[Probe]:
    """Anchor probes of the model (every variant, valid TP and micro-batch size) plus, with
    `design`, the regression design shapes of each variant."""
    probes: list[Probe] = []
    for variant in variants:
        anchors = [
            ProbeShape.of(shape, t, b)
            for t in tps
            for b in micro_batch_sizes
            if tp_fits(shape, t, variant.sequence_parallel)
        ]
        designed = design and variant.designed
        shapes = anchors + (design_shapes(variant_tps(variant, max(tps))) if designed else [])
        probes += probes_for(variant, shapes)
    return probes
