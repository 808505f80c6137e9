"""`capture-megatron fit records.jsonl --out memory_model.json`: fit and report the fit's quality."""
from __future__ import annotations

import argparse
import json

from capture_megatron.fit import MemoryModel, fit
from capture_megatron.megatron.flags import FlagParser
from capture_megatron.profile.records import read_records
from capture_megatron.serial import to_plain


def quality_rows(model: MemoryModel) -> list[tuple[str, str, int, float, float]]:
    """(variant, quantity, samples, max |residual| bytes, leave-one-out max relative error)."""
    rows = []
    for vm in model.variants:
        v = vm.variant
        name = f"{v.dtype}/{v.recompute}/{'sp' if v.sequence_parallel else 'nosp'}"
        rows.append((name, "layer saved S", vm.layer_saved.samples, vm.layer_saved.max_abs_residual,
                     vm.layer_saved.loo_max_rel_error))
        for chunk in vm.chunks:
            for field, reg in chunk.fields:
                rows.append((name, f"{chunk.kind}.{field}", reg.samples, reg.max_abs_residual, reg.loo_max_rel_error))
        for w in vm.windows:
            probe = f"{w.kind}({w.layers},{w.recompute_layers}).{w.window}"
            rows.append((name, f"{probe} peak (timeline)", w.model.samples, w.model.max_abs_residual,
                         w.model.loo_max_rel_error))
            if w.window == "forward":
                rows.append((name, f"{probe} saved (timeline)", w.model.samples, w.model.max_abs_residual,
                             w.model.kept_loo_max_rel_error))
    return rows


def print_quality(model: MemoryModel) -> None:
    """The fit-quality table."""
    print(f"memory model: {model.device}, {model.transformer_impl} spec, capture-megatron {model.versions[0]}, "
          f"torch {model.versions[1]}, megatron-core {model.versions[2]}")
    print(f"  {'variant':22s} {'quantity':34s} {'probes':>6s} {'max resid B':>12s} {'LOO max err':>12s}")
    for variant, quantity, n, resid, loo in quality_rows(model):
        print(f"  {variant:22s} {quantity:34s} {n:6d} {resid:12.0f} {100 * loo:11.3f}%")


def write_model(model: MemoryModel, path: str) -> None:
    """Write a memory model as JSON."""
    with open(path, "w") as f:
        json.dump(to_plain(model), f)


def read_model(path: str) -> MemoryModel:
    """Read a memory model written by write_model (CaptureError when unreadable)."""
    from capture_megatron.errors import CaptureError
    from capture_megatron.serial import from_plain

    try:
        with open(path) as f:
            return from_plain(MemoryModel, json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise CaptureError(f"cannot read memory model {path}: {err}; fit it again with `capture-megatron fit`")


def main(argv: list[str]) -> int:
    """Entry point."""
    p = FlagParser(prog="capture-megatron fit", description=__doc__.splitlines()[0])
    p.add_argument("records")
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true")
    ns = p.parse_args(argv)
    model = fit(read_records(ns.records))
    write_model(model, ns.out)
    if not ns.quiet:
        print_quality(model)
    print(f"wrote {ns.out}")
    return 0
