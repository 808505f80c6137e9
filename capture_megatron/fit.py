"""Fit: ProfileRecords -> MemoryModel (per variant, per chunk kind, per quantity regressions).

How a chunk's memory is decomposed (verified on the probes, see docs/MEMORY_MODEL.md):
with S the bytes one transformer layer saves per micro-batch and R those of a fully recomputed
layer (its input only), a chunk of kind K with k >= 1 layers of which the first n are recomputed
- saves      saved1_K + (k - 1 - n) * S + n * R
- peaks in forward at  fwd1_K + n * R + (k - n - 1) * S             (n < k)
                       fwdrc_K + (k - 1) * R                          (n = k)
- peaks in backward at bwd1_K                                         (n = 0)
                       max(bwd1_K, bwdmix_K - (k - n - 1) * S)        (0 < n < k)
                       bwdrc_K                                        (n = k)
and a chunk without layers (k = 0, the embedding or the output layer alone) has its own values.
Each of those per-shape constants is then regressed over the probe shapes on the terms of
capture_megatron.terms. Pure Python + numpy.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from capture_megatron.errors import CaptureError
from capture_megatron.profile.records import ProfileRecord, Variant
from capture_megatron.regression import Regression, regress
from capture_megatron.serial import JsonMixin
from capture_megatron.terms import Sizes

END_KINDS = ("first", "last", "only")


@dataclass(frozen=True)
class ChunkModel(JsonMixin):
    """Regressions of one chunk kind (first, middle, last, only)."""

    kind: str
    """Chunk kind."""
    input_bytes: Regression
    """Activation received from the previous stage."""
    saved1: Regression
    """Saved bytes with one (non-recomputed) layer."""
    fwd1: Regression
    """Forward peak with one layer."""
    bwd1: Regression
    """Backward peak with one layer."""
    step1: Regression
    """Optimizer-step peak with one layer."""
    saved0: Regression | None = None
    """Saved bytes without layers (ends only; None for middle)."""
    fwd0: Regression | None = None
    """Forward peak without layers."""
    bwd0: Regression | None = None
    """Backward peak without layers."""
    step0: Regression | None = None
    """Optimizer-step peak without layers."""
    fwdrc: Regression | None = None
    """Forward peak with one fully recomputed layer (variant 'full' only)."""
    bwdrc: Regression | None = None
    """Backward peak with one fully recomputed layer."""
    bwdmix: Regression | None = None
    """Backward peak with two layers, the first recomputed."""
    end_numels: tuple[Regression, ...] = ()
    """Element counts of the end parameters (embedding / final norm + output layer)."""


@dataclass(frozen=True)
class VariantModel(JsonMixin):
    """Everything fitted for one Variant."""

    variant: Variant
    """The categorical settings."""
    layer_saved: Regression
    """S: bytes a transformer layer saves per micro-batch."""
    layer_saved_rc: Regression | None
    """R: bytes a fully recomputed layer saves (None unless variant.recompute == 'full')."""
    layer_numels: tuple[Regression, ...]
    """Element counts of one layer's parameters, in module order."""
    chunks: tuple[ChunkModel, ...]
    """One per chunk kind."""
    buffers: tuple[tuple[str, str, Regression], ...]
    """Megatron global buffers: (name, dtype, bytes regression)."""
    ranges: tuple[tuple[str, int, int], ...]
    """(size name, min, max) over the probes, to warn about extrapolation."""

    def chunk(self, kind: str) -> ChunkModel:
        """The ChunkModel of a kind."""
        return next(c for c in self.chunks if c.kind == kind)


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
    s = rec.shape
    return Sizes(b=s.micro_batch_size, s=s.seq_length, h=s.hidden_size, a=s.num_attention_heads,
                 g=s.num_query_groups, d=s.kv_channels, f=s.ffn_hidden_size, V=s.padded_vocab, t=s.tp)


def _per_shape(records: list[ProfileRecord]) -> dict:
    """{shape: {(kind, layers, recompute_layers): record}} of the activation probes (dp 1)."""
    table = defaultdict(dict)
    for r in records:
        if r.dp == 1 and not r.distributed_optimizer:
            table[r.shape][(r.kind, r.layers, r.recompute_layers)] = r
    return table


def _need(probes: dict, key: tuple, shape) -> ProfileRecord:
    if key not in probes:
        raise CaptureError(f"records lack the probe {key} (kind, layers, recomputed) for shape {shape}; "
                           "profile again with `capture-megatron profile`")
    return probes[key]


def _chunk(kind: str, table: dict, full: bool) -> ChunkModel:
    """Per-shape constants of one kind, regressed over shapes."""
    rows = defaultdict(list)
    for shape, probes in table.items():
        one = _need(probes, (kind, 1, 0), shape)
        rows["z"].append(sizes_of(one))
        for name, val in (("input_bytes", one.input_bytes), ("saved1", one.saved_bytes), ("fwd1", one.forward_peak),
                          ("bwd1", one.backward_peak), ("step1", one.step_peak)):
            rows[name].append(val)
        if kind in END_KINDS:
            zero = _need(probes, (kind, 0, 0), shape)
            for name, val in (("saved0", zero.saved_bytes), ("fwd0", zero.forward_peak),
                              ("bwd0", zero.backward_peak), ("step0", zero.step_peak)):
                rows[name].append(val)
            rows["numels"].append(zero.param_numels)
        if full:
            rows["fwdrc"].append(_need(probes, (kind, 1, 1), shape).forward_peak)
            rows["bwdrc"].append(_need(probes, (kind, 1, 1), shape).backward_peak)
            rows["bwdmix"].append(_need(probes, (kind, 2, 1), shape).backward_peak)
    z = rows.pop("z")
    numels = rows.pop("numels", [])
    fitted = {name: regress("step" if name.startswith("step") else "activation", z, vals)
              for name, vals in rows.items()}
    ends = tuple(regress("parameter", z, [n[i] for n in numels]) for i in range(len(numels[0]))) if numels else ()
    return ChunkModel(kind=kind, end_numels=ends, **fitted)


def _buffers(records: list[ProfileRecord]) -> tuple:
    groups = defaultdict(lambda: ([], []))
    for r in records:
        if r.layers >= 1 and r.dp == 1:
            for buf in r.buffers:
                zs, vals = groups[(buf.name, buf.dtype)]
                zs.append(sizes_of(r))
                vals.append(buf.nbytes)
    return tuple((name, dtype, regress("activation", zs, vals)) for (name, dtype), (zs, vals) in sorted(groups.items()))


def _ranges(records: list[ProfileRecord]) -> tuple:
    out = []
    for field in ("micro_batch_size", "seq_length", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "padded_vocab", "tp"):
        vals = [getattr(r.shape, field) for r in records]
        out.append((field, min(vals), max(vals)))
    return tuple(out)


def fit_variant(records: list[ProfileRecord]) -> VariantModel:
    """Fit one variant's records (all of the same Variant)."""
    variant = records[0].variant
    table = _per_shape(records)
    full = variant.recompute == "full"
    z, s_vals, r_vals, numels = [], [], [], []
    for shape, probes in table.items():
        one, two = _need(probes, ("middle", 1, 0), shape), _need(probes, ("middle", 2, 0), shape)
        z.append(sizes_of(one))
        s_vals.append(two.saved_bytes - one.saved_bytes)
        numels.append(one.param_numels)
        if full:
            r_vals.append(_need(probes, ("middle", 2, 1), shape).saved_bytes - one.saved_bytes)
    layer_numels = tuple(regress("parameter", z, [n[i] for n in numels]) for i in range(len(numels[0])))
    return VariantModel(
        variant=variant, layer_saved=regress("activation", z, s_vals),
        layer_saved_rc=regress("activation", z, r_vals) if full else None, layer_numels=layer_numels,
        chunks=tuple(_chunk(kind, table, full) for kind in ("first", "middle", "last", "only")),
        buffers=_buffers(records), ranges=_ranges(records))


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
