"""Fit: ProfileRecords -> MemoryModel (per variant: per-shape constants and their regressions).

How a chunk's memory decomposes (verified on the probes; docs/MEMORY_MODEL.md): with S the bytes
one transformer layer saves per micro-batch, R what the first fully recomputed layer keeps and R2
what each further one keeps (its input), kept = R + (n - 1) * R2 (0 when n = 0), a chunk of kind K
with k >= 1 layers of which the first n are recomputed
- holds per micro-batch  saved1_K + (k - 1 - n) * S + kept          (plus the received input)
- peaks in forward at     fwd1_K + kept + (k - n - 1) * S + (R2 - R)  (0 < n < k; n = 0: fwd1_K + (k-1) S)
                          fwdrc_K + (k - 1) * R2                      (n = k)
- peaks in backward at    bwd1_K                                      (n = 0)
                          max(bwd1_K, bwdmix_K - (k - n - 1) * S)     (0 < n < k)
                          bwdrc_K                                     (n = k)
and a chunk without layers (k = 0: the embedding or the head alone) has its own *0 values.
For every probed shape these constants are kept exactly (anchors: a prediction at a probed shape
is exact); across shapes each constant is regressed on the terms of capture_megatron.terms, or, when
the records carry allocation timelines, replayed event by event (capture_megatron.fit_windows): this
follows which temporaries coexist at a peak, and which tensors exist at all, as the shape changes,
which one regression cannot. Pure Python + numpy.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from capture_megatron.errors import CaptureError
from capture_megatron.fit_windows import ProbeWindow, fit_windows, replayed
from capture_megatron.profile.records import ProfileRecord, Variant
from capture_megatron.regression import Regression, regress
from capture_megatron.serial import JsonMixin
from capture_megatron.terms import Sizes

KINDS = ("first", "middle", "last", "only")
END_KINDS = ("first", "last", "only")


@dataclass(frozen=True)
class KindConstants(JsonMixin):
    """The decomposition constants of one chunk kind at one shape (bytes; None when not probed)."""

    kind: str
    """first, middle, last or only."""
    input_bytes: float
    """Activation received from the previous stage per micro-batch."""
    saved1: float
    """Saved bytes with one layer."""
    fwd1: float
    """Forward peak with one layer."""
    bwd1: float
    """Backward peak with one layer."""
    step1: float
    """Optimizer-step peak with one layer."""
    saved0: float | None = None
    """Saved bytes without layers (ends only)."""
    fwd0: float | None = None
    """Forward peak without layers."""
    bwd0: float | None = None
    """Backward peak without layers."""
    step0: float | None = None
    """Optimizer-step peak without layers."""
    fwdrc: float | None = None
    """Forward peak with one fully recomputed layer."""
    bwdrc: float | None = None
    """Backward peak with one fully recomputed layer."""
    bwdmix: float | None = None
    """Backward peak with two layers, the first recomputed."""
    end_numels: tuple[int, ...] = ()
    """Element counts of the end parameters (embedding, or final norm + output layer)."""


@dataclass(frozen=True)
class ShapeConstants(JsonMixin):
    """Everything the predictor needs at one shape."""

    sizes: Sizes
    """The shape."""
    layer_saved: float
    """S."""
    layer_saved_rc: float | None
    """R: what the first recomputed layer of a chunk keeps (full recompute only)."""
    layer_numels: tuple[int, ...]
    """One layer's parameter element counts, in module order."""
    chunks: tuple[KindConstants, ...]
    """One per chunk kind."""
    buffers: float
    """Megatron's global buffers with at least one layer."""
    layer_saved_rc_next: float | None = None
    """R2: what each recomputed layer after the first keeps (its input; full recompute only). The
    first recomputed layer of a chunk may keep less (its input is the chunk's input): R."""

    def chunk(self, kind: str) -> KindConstants:
        """The constants of one kind."""
        return next(c for c in self.chunks if c.kind == kind)


@dataclass(frozen=True)
class ChunkModel(JsonMixin):
    """Regressions of one chunk kind's constants (field names as in KindConstants)."""

    kind: str
    """Chunk kind."""
    fields: tuple[tuple[str, Regression], ...]
    """(KindConstants field, regression) for every probed scalar field."""
    end_numels: tuple[Regression, ...]
    """Regressions of the end parameters' element counts."""

    def at(self, z: Sizes) -> KindConstants:
        """The constants this model predicts at `z`."""
        values = {name: reg.predict(z) for name, reg in self.fields}
        return KindConstants(kind=self.kind, end_numels=tuple(round(r.predict(z)) for r in self.end_numels),
                             **values)


@dataclass(frozen=True)
class VariantModel(JsonMixin):
    """Everything fitted for one Variant."""

    variant: Variant
    """The categorical settings."""
    anchors: tuple[ShapeConstants, ...]
    """Exact constants at every probed shape."""
    layer_saved: Regression
    """S over shapes."""
    layer_saved_rc: Regression | None
    """R over shapes (full recompute only)."""
    layer_numels: tuple[Regression, ...]
    """One layer's parameter element counts over shapes."""
    chunks: tuple[ChunkModel, ...]
    """One per chunk kind."""
    buffers: Regression
    """Global buffer bytes over shapes."""
    ranges: tuple[tuple[str, int, int], ...]
    """(size, min, max) over the probes, for extrapolation warnings."""
    layer_saved_rc_next: Regression | None = None
    """R2 over shapes (full recompute only)."""
    windows: tuple[ProbeWindow, ...] = ()
    """Replayed allocation timelines of the probes' windows (records profiled with timelines); where
    present they give the saved bytes and peaks instead of the regressions."""

    def constants(self, z: Sizes) -> ShapeConstants:
        """Exact constants when `z` was probed, else the replayed timelines' / regressions' prediction."""
        for anchor in self.anchors:
            if anchor.sizes == z:
                return anchor
        rc = self.layer_saved_rc.predict(z) if self.layer_saved_rc is not None else None
        rc2 = self.layer_saved_rc_next.predict(z) if self.layer_saved_rc_next is not None else None
        regressed = ShapeConstants(sizes=z, layer_saved=self.layer_saved.predict(z), layer_saved_rc=rc,
                                   layer_numels=tuple(round(r.predict(z)) for r in self.layer_numels),
                                   chunks=tuple(c.at(z) for c in self.chunks), buffers=self.buffers.predict(z),
                                   layer_saved_rc_next=rc2)
        return replayed(regressed, self.windows) if self.windows else regressed


@dataclass(frozen=True)
class MemoryModel(JsonMixin):
    """The fitted memory model of one device / implementation / software stack."""

    device: str
    """cpu, cuda or fake."""
    transformer_impl: str
    """local or transformer_engine."""
    versions: tuple[str, str, str]
    """(capture-megatron, torch, megatron-core) of the probes."""
    variants: tuple[VariantModel, ...]
    """One per profiled Variant."""


def sizes_of(rec: ProfileRecord) -> Sizes:
    """Term sizes of a record's probe shape."""
    return shape_sizes(rec.shape)


def shape_sizes(s) -> Sizes:
    """Term sizes of a ProbeShape."""
    return Sizes(b=s.micro_batch_size, s=s.seq_length, h=s.hidden_size, a=s.num_attention_heads,
                 g=s.num_query_groups, d=s.kv_channels, f=s.ffn_hidden_size, V=s.padded_vocab, t=s.tp)


def _need(probes: dict, key: tuple, z: Sizes) -> ProfileRecord:
    if key not in probes:
        raise CaptureError(f"records lack the probe (kind, layers, recomputed) = {key} at {z}; "
                           "profile again with `capture-megatron profile`")
    return probes[key]


def _kind_constants(kind: str, probes: dict, z: Sizes, full: bool) -> KindConstants:
    one = _need(probes, (kind, 1, 0), z)
    values = dict(input_bytes=one.input_bytes, saved1=one.saved_bytes, fwd1=one.forward_peak,
                  bwd1=one.backward_peak, step1=one.step_peak)
    numels = ()
    if kind in END_KINDS:
        zero = _need(probes, (kind, 0, 0), z)
        values.update(saved0=zero.saved_bytes, fwd0=zero.forward_peak, bwd0=zero.backward_peak,
                      step0=zero.step_peak)
        numels = zero.param_numels
    if full:
        rc, mix = _need(probes, (kind, 1, 1), z), _need(probes, (kind, 2, 1), z)
        values.update(fwdrc=rc.forward_peak, bwdrc=rc.backward_peak, bwdmix=mix.backward_peak)
    return KindConstants(kind=kind, end_numels=numels, **values)


def shape_constants(probes: dict, full: bool) -> ShapeConstants:
    """Decompose the probes of one shape ({(kind, layers, recomputed): record})."""
    z = sizes_of(next(iter(probes.values())))
    one, two = _need(probes, ("middle", 1, 0), z), _need(probes, ("middle", 2, 0), z)
    rc = _need(probes, ("middle", 2, 1), z).saved_bytes - one.saved_bytes if full else None
    rc2 = (_need(probes, ("middle", 2, 2), z).saved_bytes - _need(probes, ("middle", 1, 1), z).saved_bytes
           if full else None)
    return ShapeConstants(sizes=z, layer_saved=two.saved_bytes - one.saved_bytes, layer_saved_rc=rc,
                          layer_numels=one.param_numels,
                          chunks=tuple(_kind_constants(k, probes, z, full) for k in KINDS),
                          buffers=sum(b.nbytes for b in one.buffers), layer_saved_rc_next=rc2)


def _chunk_model(kind: str, anchors: list[ShapeConstants]) -> ChunkModel:
    zs = [a.sizes for a in anchors]
    rows = [a.chunk(kind) for a in anchors]
    fields = []
    for f in dataclasses.fields(KindConstants):
        if f.name in ("kind", "end_numels") or getattr(rows[0], f.name) is None:
            continue
        term_set = "step" if f.name.startswith("step") else "activation"
        fields.append((f.name, regress(term_set, zs, [getattr(r, f.name) for r in rows])))
    n_ends = len(rows[0].end_numels)
    ends = tuple(regress("parameter", zs, [r.end_numels[i] for r in rows]) for i in range(n_ends))
    return ChunkModel(kind=kind, fields=tuple(fields), end_numels=ends)


def _ranges(anchors: list[ShapeConstants]) -> tuple:
    return tuple((name, min(getattr(a.sizes, name) for a in anchors), max(getattr(a.sizes, name) for a in anchors))
                 for name in ("b", "s", "h", "a", "g", "d", "f", "V", "t"))


def fit_variant(records: list[ProfileRecord]) -> VariantModel:
    """Fit one variant's records (all of the same Variant)."""
    variant = records[0].variant
    full = variant.recompute == "full"
    table = defaultdict(dict)
    for r in records:
        if r.dp == 1 and not r.distributed_optimizer:
            table[r.shape][(r.kind, r.layers, r.recompute_layers)] = r
    anchors = [shape_constants(probes, full) for probes in table.values()]
    zs = [a.sizes for a in anchors]
    numels = [a.layer_numels for a in anchors]
    return VariantModel(
        variant=variant, anchors=tuple(anchors),
        layer_saved=regress("activation", zs, [a.layer_saved for a in anchors]),
        layer_saved_rc=regress("activation", zs, [a.layer_saved_rc for a in anchors]) if full else None,
        layer_numels=tuple(regress("parameter", zs, [n[i] for n in numels]) for i in range(len(numels[0]))),
        chunks=tuple(_chunk_model(k, anchors) for k in KINDS),
        buffers=regress("activation", zs, [a.buffers for a in anchors]), ranges=_ranges(anchors),
        layer_saved_rc_next=regress("activation", zs, [a.layer_saved_rc_next for a in anchors]) if full else None,
        windows=fit_windows(zs, list(table.values())))


def fit(records: list[ProfileRecord]) -> MemoryModel:
    """Fit every variant present in `records` (which must come from one device/impl/version)."""
    if not records:
        raise CaptureError("no records to fit")
    origins = {(r.device, r.transformer_impl, r.versions) for r in records}
    if len(origins) > 1:
        raise CaptureError(f"records mix devices/implementations/versions {sorted(origins)}; fit each separately")
    by_variant = defaultdict(list)
    for r in records:
        by_variant[r.variant].append(r)
    device, impl, versions = origins.pop()
    return MemoryModel(device=device, transformer_impl=impl, versions=versions,
                       variants=tuple(fit_variant(rs) for rs in by_variant.values()))
