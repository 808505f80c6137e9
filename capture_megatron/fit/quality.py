"""How good a fit is: each fitted quantity's sample count, largest residual and leave-one-out
error, for the `capture-megatron fit` table, and which regression rows predictions do not use
because a replayed timeline gives the same quantity (capture_megatron.fit.model._replayed)."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.fit.model import MemoryModel, VariantModel
from capture_megatron.fit.timelines.windows import FIELDS, KEPT, LAYER_FIELDS, ProbeWindow


@dataclass(frozen=True)
class QualityRow:
    """One fitted quantity of one variant."""

    variant: str
    """dtype/recompute/sp of the variant."""
    quantity: str
    """What was fitted: a regression (`middle.fwd1`) or a replayed timeline (`... (timeline)`)."""
    samples: int
    """Probed shapes it was fitted on."""
    max_abs_residual: float
    """Largest |fitted - measured| over those shapes, bytes."""
    loo_max_rel_error: float
    """Leave-one-out: the largest relative error predicting a shape fitted without it."""
    replaced_by: str = ""
    """The timeline row whose replay predictions use instead of this regression ('' if used)."""


def _probe(w: ProbeWindow) -> str:
    """A timeline row's name without its suffix."""
    return f"{w.kind}({w.layers},{w.recompute_layers}).{w.window}"


def _timeline_rows(name: str, vm: VariantModel) -> list[QualityRow]:
    """Each window's peak row and, for forward windows, its saved-bytes row."""
    rows = []
    for w in vm.windows:
        m = w.model
        rows.append(
            QualityRow(
                name,
                f"{_probe(w)} peak (timeline)",
                m.samples,
                m.max_abs_residual,
                m.loo_max_rel_error,
            )
        )
        if w.window == "forward":
            rows.append(
                QualityRow(
                    name,
                    f"{_probe(w)} saved (timeline)",
                    m.samples,
                    m.max_abs_residual,
                    m.kept_loo_max_rel_error,
                )
            )
    return rows


def _replacements(vm: VariantModel) -> dict[tuple[str, str], str]:
    """(chunk kind, KindConstants field) -> the timeline row replacing its regression; the key
    ("", "layer_saved") for S."""
    table = {(w.kind, w.layers, w.recompute_layers, w.window): w for w in vm.windows}
    out: dict[tuple[str, str], str] = {}
    for chunk in vm.chunks:
        for field, (layers, rc, window) in FIELDS.items():
            w = table.get((chunk.kind, layers, rc, "forward" if window == KEPT else window))
            if w is not None:
                suffix = "saved" if window == KEPT else "peak"
                out[(chunk.kind, field)] = f"{_probe(w)} {suffix} (timeline)"
    plus, minus = LAYER_FIELDS["layer_saved"]
    a, b = (table.get(("middle", *p, "forward")) for p in (plus, minus))
    if a is not None and b is not None:
        out[("", "layer_saved")] = f"{_probe(a)} - {_probe(b)} saved (timeline)"
    return out


def quality_rows(model: MemoryModel) -> list[QualityRow]:
    """Every variant's regression rows (each marked with the timeline row replacing it, if any),
    then its timeline rows."""
    rows = []
    for vm in model.variants:
        v = vm.variant
        name = f"{v.dtype}/{v.recompute}/{'sp' if v.sequence_parallel else 'nosp'}"
        replaced = _replacements(vm)
        s = vm.layer_saved
        rows.append(
            QualityRow(
                name,
                "layer saved S",
                s.samples,
                s.max_abs_residual,
                s.loo_max_rel_error,
                replaced.get(("", "layer_saved"), ""),
            )
        )
        for chunk in vm.chunks:
            for field, reg in chunk.fields:
                rows.append(
                    QualityRow(
                        name,
                        f"{chunk.kind}.{field}",
                        reg.samples,
                        reg.max_abs_residual,
                        reg.loo_max_rel_error,
                        replaced.get((chunk.kind, field), ""),
                    )
                )
        rows += _timeline_rows(name, vm)
    return rows


def used_error(rows: list[QualityRow]) -> QualityRow | None:
    """The row with the largest leave-one-out error among those predictions use (None: no row)."""
    used = [r for r in rows if not r.replaced_by]
    return max(used, key=lambda r: r.loo_max_rel_error, default=None)
