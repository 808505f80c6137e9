"""Reading and writing a fitted MemoryModel as JSON (`capture-megatron fit --out`,
`--memory-model`)."""

from __future__ import annotations

import json

from capture_megatron.config import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.fit.model import MemoryModel
from capture_megatron.serial import from_plain, to_plain


def write_model(model: MemoryModel, path: str) -> None:
    """Write a memory model as JSON."""
    with open(path, "w") as f:
        json.dump(to_plain(model), f)


def read_model(path: str) -> MemoryModel:
    """Read a memory model written by write_model (CaptureError when unreadable)."""
    try:
        with open(path) as f:
            return from_plain(MemoryModel, json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise CaptureError(
            f"cannot read memory model {path}: {err}; fit it again with `capture-megatron fit`"
        ) from None


def _own_sizes(shape: ModelShape) -> tuple[int, ...]:
    """(s, h, a, g, d, f): the sizes of a model that no plan changes."""
    return (
        shape.seq_length,
        shape.hidden_size,
        shape.num_attention_heads,
        shape.groups,
        shape.head_dim,
        shape.ffn,
    )


def _describe(sizes: tuple[int, ...], padded_vocab: int) -> str:
    s, h, a, g, d, f = sizes
    return (
        f"sequence {s}, hidden {h}, {a} heads in {g} query groups of width {d}, MLP {f}, padded "
        f"vocabulary {padded_vocab}"
    )


def _spans(model: MemoryModel) -> dict[str, tuple[int, int]]:
    """Each size's (min, max) over every probe: the fitted `ranges` and the anchors."""
    spans: dict[str, tuple[int, int]] = {}
    points = [r for vm in model.variants for r in vm.ranges] + [
        (name, getattr(a.sizes, name), getattr(a.sizes, name))
        for vm in model.variants
        for a in vm.anchors
        for name in ("b", "s", "h", "a", "g", "d", "f", "V", "t")
    ]
    for name, lo, hi in points:
        old = spans.get(name, (lo, hi))
        spans[name] = (min(old[0], lo), max(old[1], hi))
    return spans


def check_fitted(model: MemoryModel, shape: ModelShape, path: str, version: str) -> None:
    """CaptureError unless `model` was fitted by this capture-megatron `version` for `shape`:
    one of its anchors (the model's own probed shapes) has the shape's sizes. A memory model is
    exact at its anchors and regressed between shapes of the same model (micro-batch, TP); for
    another model its terms would be extrapolated from shapes it never saw (a model fitted at
    hidden 64 predicted the same peak at hidden 4096, and one fitted on another model was 79% low),
    so it is refused with what it was fitted for and its probes' ranges."""
    if model.versions[0] != version:
        raise CaptureError(
            f"--memory-model {path} was fitted by capture-megatron {model.versions[0]} (torch "
            f"{model.versions[1]}, megatron-core {model.versions[2]}); this is capture-megatron "
            f"{version}, whose probes and memory model differ: profile and fit it again, or "
            "drop --memory-model to profile on the spot"
        )
    own = _own_sizes(shape)
    fitted: dict[tuple[int, ...], int] = {}
    for vm in model.variants:
        for anchor in vm.anchors:
            z = anchor.sizes
            key = (z.s, z.h, z.a, z.g, z.d, z.f)
            if key == own and shape.padded_vocab(z.t) == z.V:
                return
            fitted.setdefault(key, z.V)
    ranges = "; ".join(f"{n} {lo}-{hi}" for n, (lo, hi) in _spans(model).items())
    fitted_text = " | ".join(_describe(k, v) for k, v in list(fitted.items())[:3]) or "nothing"
    raise CaptureError(
        f"--memory-model {path} was fitted for a model of {fitted_text} (its probes span "
        f"{ranges or 'nothing'}); this model has {_describe(own, shape.padded_vocab(1))} (at TP "
        "1), so every prediction would be extrapolated from another model. Profile and fit one "
        "for this model (`capture-megatron profile <these model flags> --out r.jsonl` then "
        "`capture-megatron fit r.jsonl`), or drop --memory-model to profile on the spot"
    )
