"""Held-out checks: a fitted variant's predictions against probes it was not fitted on.

Used by the tests and bench/profile_quality.py: saved activations and transient peaks within 1% on
unseen shapes, parameters / gradients / optimizer bytes exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.fit import VariantModel, sizes_of
from capture_megatron.fit.timelines.windows import FIELDS, KEPT
from capture_megatron.forecast.static import chunk_static
from capture_megatron.records import ProfileRecord

MEASURED = {
    KEPT: "saved_bytes",
    "forward": "forward_peak",
    "backward": "backward_peak",
    "step": "step_peak",
}
"""Window (fit_windows.FIELDS) -> the ProfileRecord field that measured it."""


@dataclass(frozen=True)
class Check:
    """One predicted quantity of one probe against its measurement."""

    kind: str
    """Chunk kind of the probe."""
    layers: int
    """Transformer layers of the probe."""
    recompute_layers: int
    """Of which fully recomputed."""
    quantity: str
    """KindConstants field (saved1, fwd1, bwdmix, ...), 'layer saved S' or
    params/grads/optimizer."""
    predicted: float
    """Bytes the model predicts."""
    measured: float
    """Bytes the probe measured."""

    @property
    def rel_error(self) -> float:
        """|predicted - measured| / measured (absolute bytes when nothing was measured)."""
        return abs(self.predicted - self.measured) / (self.measured or 1.0)

    @property
    def transient(self) -> bool:
        """Whether this is a forward / backward / step peak."""
        return self.quantity in FIELDS and FIELDS[self.quantity][2] != KEPT


def _record_checks(vm: VariantModel, rec: ProfileRecord) -> list[Check]:
    kc = vm.constants(sizes_of(rec)).chunk(rec.kind)
    key = (rec.layers, rec.recompute_layers)
    fields = [
        (name, getattr(rec, MEASURED[window]))
        for name, (layers, rc, window) in FIELDS.items()
        if (layers, rc) == key and not (window == "step" and rec.device == "fake")
    ]
    return [
        Check(
            rec.kind, rec.layers, rec.recompute_layers, name, float(getattr(kc, name)), float(meas)
        )
        for name, meas in fields
        if getattr(kc, name, None) is not None
    ]


def _layer_checks(vm: VariantModel, one: ProfileRecord, two: ProfileRecord) -> list[Check]:
    """S from a middle chunk of two layers minus one, and one layer's static bytes."""
    c = vm.constants(sizes_of(one))
    static = chunk_static(
        list(c.layer_numels), one.variant.dtype, one.dp, one.distributed_optimizer
    )
    pairs = [
        ("layer saved S", c.layer_saved, two.saved_bytes - one.saved_bytes),
        ("params", static.params, one.param_bytes),
        ("grads", static.grads, one.grad_bytes),
        ("optimizer", static.optimizer, one.optimizer_bytes),
    ]
    return [Check("middle", 1, 0, name, float(p), float(m)) for name, p, m in pairs]


def check_records(vm: VariantModel, records: list[ProfileRecord]) -> list[Check]:
    """Every prediction of `vm` the records can check (they must be of vm's variant, dp 1)."""
    checks = [c for rec in records for c in _record_checks(vm, rec)]
    by_key = {(r.shape, r.kind, r.layers, r.recompute_layers): r for r in records}
    for (shape, kind, layers, rc), one in by_key.items():
        two = by_key.get((shape, "middle", 2, 0))
        if (kind, layers, rc) == ("middle", 1, 0) and two is not None:
            checks += _layer_checks(vm, one, two)
    return checks
