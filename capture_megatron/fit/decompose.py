"""Fit: ProfileRecords -> MemoryModel (per variant: per-shape constants and their regressions).

How a chunk's memory decomposes (verified on the probes; docs/MEMORY_MODEL.md): with S the bytes
one transformer layer saves per micro-batch, R what the first fully recomputed layer keeps and R2
what each further one keeps (its input), kept = R + (n - 1) * R2 (0 when n = 0), a chunk of kind K
with k >= 1 layers of which the first n are recomputed
- holds per micro-batch  saved1_K + (k - 1 - n) * S + kept          (plus the received input)
- peaks in forward at     fwd1_K + kept + (k - n - 1) * S + (R2 - R)  (0 < n < k; n = 0: fwd1_K +
  (k-1) S)
                          fwdrc_K + (k - 1) * R2                      (n = k)
- peaks in backward at    bwd1_K                                      (n = 0)
                          max(bwd1_K, bwdmix_K - (k - n - 1) * S)     (0 < n < k)
                          bwdrc_K                                     (n = k)
and a chunk without layers (k = 0: the embedding or the head alone) has its own *0 values. For every
probed shape these constants are kept exactly (anchors: a prediction at a probed shape is exact);
across shapes each constant is regressed on the terms of capture_megatron.fit.terms, or, when the
records carry allocation timelines, replayed event by event
(capture_megatron.fit.timelines.windows): this follows which temporaries coexist at a peak, and
which tensors exist at all, as the shape changes, which one regression cannot. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from capture_megatron.errors import CaptureError
from capture_megatron.fit.model import (
    END_KINDS,
    KINDS,
    SCALAR_CONSTANTS,
    ChunkModel,
    KindConstants,
    MemoryModel,
    ShapeConstants,
    VariantModel,
)
from capture_megatron.fit.regression import Regression, regress
from capture_megatron.fit.terms import Sizes
from capture_megatron.fit.timelines.windows import ProbeKey, fit_windows
from capture_megatron.records import ProbeShape, ProfileRecord


def sizes_of(rec: ProfileRecord) -> Sizes:
    """Term sizes of a record's probe shape."""
    return shape_sizes(rec.shape)


def shape_sizes(s: ProbeShape) -> Sizes:
    """Term sizes of a ProbeShape."""
    return Sizes(
        b=s.micro_batch_size,
        s=s.seq_length,
        h=s.hidden_size,
        a=s.num_attention_heads,
        g=s.num_query_groups,
        d=s.kv_channels,
        f=s.ffn_hidden_size,
        V=s.padded_vocab,
        t=s.tp,
    )


def _need(probes: dict[ProbeKey, ProfileRecord], key: ProbeKey, z: Sizes) -> ProfileRecord:
    if key not in probes:
        raise CaptureError(
            f"records lack the probe (kind, layers, recomputed) = {key} at {z}; "
            "profile again with `capture-megatron profile`"
        )
    return probes[key]


def _kind_constants(
    kind: str, probes: dict[ProbeKey, ProfileRecord], z: Sizes, full: bool
) -> KindConstants:
    one = _need(probes, (kind, 1, 0), z)
    values = dict(
        input_bytes=one.input_bytes,
        saved1=one.saved_bytes,
        fwd1=one.forward_peak,
        bwd1=one.backward_peak,
        step1=one.step_peak,
        buffers1=sum(b.nbytes for b in one.buffers),
        ret1=one.retained_bytes,
        grad1=one.retained_grad_bytes,
        state1=one.routing_state_bytes,
        lpstate1=one.low_precision_state_bytes,
        lbuf1=one.layer_buffer_bytes,
    )
    two_kept = probes.get((kind, 2, 0))
    if two_kept is not None:
        values.update(retk2=two_kept.retained_bytes)
    numels: tuple[int, ...] = ()
    expert: tuple[bool, ...] = ()
    if kind in END_KINDS:
        zero = _need(probes, (kind, 0, 0), z)
        values.update(
            saved0=zero.saved_bytes,
            fwd0=zero.forward_peak,
            bwd0=zero.backward_peak,
            step0=zero.step_peak,
            buffers0=sum(b.nbytes for b in zero.buffers),
        )
        numels, expert = _end_numels(kind, probes, z)
    if full:
        rc, mix = _need(probes, (kind, 1, 1), z), _need(probes, (kind, 2, 1), z)
        values.update(fwdrc=rc.forward_peak, bwdrc=rc.backward_peak, bwdmix=mix.backward_peak)
        values.update(retrc=rc.retained_bytes, gradrc=rc.retained_grad_bytes)
        values.update(retmix=mix.retained_bytes, gradmix=mix.retained_grad_bytes)
        two = probes.get((kind, 2, 2))
        if two is not None:
            values.update(ret2=two.retained_bytes, bwdrc2=two.backward_peak)
    routed = expert if any(expert) else ()
    return KindConstants(kind=kind, end_numels=numels, end_expert=routed, **values)


def _end_numels(
    kind: str, probes: dict[ProbeKey, ProfileRecord], z: Sizes
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Parameter element counts of a kind's ends in module order, and per entry whether it is a
    routed expert's: the chunk without layers.

    With multi-token prediction megatron-core puts the decoder's final norm on the stage that holds
    its last layer, so the last / only chunk without layers lacks it: there the ends are the
    one-layer chunk's parameters less the layer's (the embedding's tensors come first, then the
    layer's, then the final norm, the MTP layers and the output layer)."""
    zero = _need(probes, (kind, 0, 0), z)
    if not zero.variant.mtp or kind not in ("last", "only"):
        return zero.param_numels, _mask(zero)
    one = _need(probes, (kind, 1, 0), z)
    head = len(_need(probes, ("first", 0, 0), z).param_numels)  # the embedding's tensors
    layer = len(_need(probes, ("middle", 1, 0), z).param_numels)
    numels, expert = one.param_numels, _mask(one)
    return numels[:head] + numels[head + layer :], expert[:head] + expert[head + layer :]


def _mask(rec: ProfileRecord) -> tuple[bool, ...]:
    """Per parameter of a record, whether it is a routed expert's."""
    return rec.param_expert or (False,) * len(rec.param_numels)


def shape_constants(probes: dict[ProbeKey, ProfileRecord], full: bool) -> ShapeConstants:
    """Decompose the probes of one shape ({(kind, layers, recomputed): record})."""
    z = sizes_of(next(iter(probes.values())))
    one, two = _need(probes, ("middle", 1, 0), z), _need(probes, ("middle", 2, 0), z)
    rc = _need(probes, ("middle", 2, 1), z).saved_bytes - one.saved_bytes if full else None
    rc2 = (
        _need(probes, ("middle", 2, 2), z).saved_bytes
        - _need(probes, ("middle", 1, 1), z).saved_bytes
        if full
        else None
    )
    return ShapeConstants(
        sizes=z,
        layer_saved=two.saved_bytes - one.saved_bytes,
        layer_saved_rc=rc,
        layer_numels=one.param_numels,
        chunks=tuple(_kind_constants(k, probes, z, full) for k in KINDS),
        buffers=sum(b.nbytes for b in one.buffers),
        layer_saved_rc_next=rc2,
        layer_expert=one.param_expert,
        layer_low_precision=one.param_low_precision,
        layer_offload=one.offload_tensors,
    )


def _chunk_model(kind: str, anchors: list[ShapeConstants]) -> ChunkModel:
    zs = [a.sizes for a in anchors]
    rows = [a.chunk(kind) for a in anchors]
    fields = []
    for f in dataclasses.fields(KindConstants):
        if f.name not in SCALAR_CONSTANTS or getattr(rows[0], f.name) is None:
            continue
        term_set = (
            "step"
            if f.name.startswith("step")
            else ("buffer" if f.name.startswith("buffers") else "activation")
        )
        term_set = "parameter" if f.name.startswith("lpstate") else term_set
        fields.append((f.name, regress(term_set, zs, [getattr(r, f.name) for r in rows])))
    n_ends = len(rows[0].end_numels)
    ends = tuple(regress("parameter", zs, [r.end_numels[i] for r in rows]) for i in range(n_ends))
    expert = rows[0].end_expert
    return ChunkModel(kind=kind, fields=tuple(fields), end_numels=ends, end_expert=expert)


def _ranges(anchors: list[ShapeConstants]) -> tuple[tuple[str, int, int], ...]:
    return tuple(
        (
            name,
            min(getattr(a.sizes, name) for a in anchors),
            max(getattr(a.sizes, name) for a in anchors),
        )
        for name in ("b", "s", "h", "a", "g", "d", "f", "V", "t")
    )


def _regress_all(zs: list[Sizes], values: list[float | None]) -> Regression:
    """An activation regression of values every probed shape has (full recompute's R and R2)."""
    known = [v for v in values if v is not None]
    if len(known) < len(values):
        raise CaptureError("records lack full-recompute probes at some shapes; profile again")
    return regress("activation", zs, known)


def fit_variant(records: list[ProfileRecord]) -> VariantModel:
    """Fit one variant's records (all of the same Variant)."""
    variant = records[0].variant
    full = variant.recompute == "full"
    table: defaultdict[ProbeShape, dict[ProbeKey, ProfileRecord]] = defaultdict(dict)
    for r in records:
        if r.dp == 1 and not r.distributed_optimizer:
            table[r.shape][(r.kind, r.layers, r.recompute_layers)] = r
    anchors = [shape_constants(probes, full) for probes in table.values()]
    zs = [a.sizes for a in anchors]
    numels = [a.layer_numels for a in anchors]
    return VariantModel(
        variant=variant,
        anchors=tuple(anchors),
        layer_saved=regress("activation", zs, [a.layer_saved for a in anchors]),
        layer_saved_rc=_regress_all(zs, [a.layer_saved_rc for a in anchors]) if full else None,
        layer_numels=tuple(
            regress("parameter", zs, [n[i] for n in numels]) for i in range(len(numels[0]))
        ),
        chunks=tuple(_chunk_model(k, anchors) for k in KINDS),
        buffers=regress("buffer", zs, [a.buffers for a in anchors]),
        ranges=_ranges(anchors),
        layer_saved_rc_next=_regress_all(zs, [a.layer_saved_rc_next for a in anchors])
        if full
        else None,
        workspace_bytes=max(r.workspace_bytes for r in records),
        windows=fit_windows(zs, list(table.values())),
        layer_expert=anchors[0].layer_expert,
        layer_low_precision=anchors[0].layer_low_precision,
    )


VariantMemo = dict[object, tuple[tuple[ProfileRecord, ...], VariantModel]]
"""A variant's records (the objects themselves) and their fit, kept by a caller that fits
growing record lists (capture_megatron.profile.source: a search's profiling rounds)."""


def fit(records: list[ProfileRecord], memo: VariantMemo | None = None) -> MemoryModel:
    """Fit every variant present in `records` (which must come from one device/impl/version);
    with `memo`, a variant whose records are the very objects fitted before keeps that fit."""
    if not records:
        raise CaptureError("no records to fit")
    origins = {(r.device, r.kernels, r.versions) for r in records}
    if len(origins) > 1:
        raise CaptureError(
            f"records mix devices/implementations/versions {sorted(origins)}; fit each separately"
        )
    by_variant = defaultdict(list)
    for r in records:
        by_variant[r.variant].append(r)
    device, impl, versions = origins.pop()
    return MemoryModel(
        device=device,
        kernels=impl,
        versions=versions,
        variants=tuple(_fit_kept(rs, memo) for rs in by_variant.values()),
    )


def _fit_kept(records: list[ProfileRecord], memo: VariantMemo | None) -> VariantModel:
    """fit_variant, or the fit `memo` keeps of these very record objects (fit_variant reads
    nothing else)."""
    if memo is None:
        return fit_variant(records)
    kept = memo.get(records[0].variant)
    same = kept is not None and len(kept[0]) == len(records)
    if kept is not None and same and all(a is b for a, b in zip(kept[0], records, strict=True)):
        return kept[1]
    fitted = fit_variant(records)
    memo[records[0].variant] = (tuple(records), fitted)
    return fitted
