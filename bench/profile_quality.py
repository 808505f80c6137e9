"""Benchmark: what profiling costs and how well the fitted models predict shapes they never saw.

Per variant: profiles the 24 design shapes on CPU (real megatron-core chunks, exact tensor
accounting, allocation timelines), fits, records probe runs, seconds and every model's leave-one-out
error; then profiles held-out shapes (none in the probe set; hidden, heads, query groups, ffn, seq,
micro-batch, TP, SP, recompute and dtype all varied across them) and compares every prediction with
the measurement: saved activations, transient peaks (forward / backward / step), static bytes.

    python bench/profile_quality.py [--out bench/results/profile_quality.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from capture_megatron.fit import fit
from capture_megatron.fit.timelines.windows import FIELDS, KEPT
from capture_megatron.forecast.heldout import check_records
from capture_megatron.profile.design import design_shapes, probes_for, variant_tps
from capture_megatron.profile.session import run_probes
from capture_megatron.records import ProbeShape, Variant

GPT = Variant(
    dtype="fp32",
    recompute="none",
    sequence_parallel=False,
    swiglu=False,
    normalization="LayerNorm",
    position_embedding_type="learned_absolute",
    add_bias_linear=True,
    dropout=True,
    untied=False,
)
LLAMA = Variant(
    dtype="bf16",
    recompute="selective",
    sequence_parallel=True,
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    dropout=False,
    untied=True,
)
# ProbeShape(micro-batch, seq, hidden, heads, query groups, kv channels, ffn, padded vocab, TP)
VARIANTS = {
    "gpt fp32": (
        GPT,
        [
            ProbeShape(2, 160, 80, 5, 5, 16, 272, 384, 1),
            ProbeShape(1, 224, 112, 4, 2, 28, 176, 512, 2),
            ProbeShape(3, 96, 160, 8, 4, 20, 400, 768, 4),
        ],
    ),
    "llama bf16 sp selective": (
        LLAMA,
        [
            ProbeShape(2, 96, 96, 8, 4, 16, 224, 512, 2),
            ProbeShape(1, 128, 64, 4, 4, 24, 160, 512, 4),
            ProbeShape(3, 64, 80, 4, 2, 8, 320, 384, 2),
        ],
    ),
    "gpt bf16 sp full": (
        dataclasses.replace(GPT, dtype="bf16", recompute="full", sequence_parallel=True),
        [
            ProbeShape(2, 64, 112, 8, 4, 16, 256, 256, 2),
            ProbeShape(1, 192, 48, 4, 4, 12, 128, 512, 4),
        ],
    ),
    "llama fp32": (
        dataclasses.replace(LLAMA, dtype="fp32", recompute="none", sequence_parallel=False),
        [
            ProbeShape(2, 160, 80, 5, 5, 16, 272, 384, 1),
            ProbeShape(1, 64, 144, 12, 4, 12, 288, 256, 1),
        ],
    ),
    "gpt bf16 selective": (
        dataclasses.replace(GPT, dtype="bf16", recompute="selective"),
        [
            ProbeShape(2, 320, 48, 6, 3, 8, 96, 1152, 3),
            ProbeShape(1, 64, 144, 12, 12, 12, 288, 256, 1),
            ProbeShape(4, 80, 64, 4, 4, 16, 256, 512, 2),
        ],
    ),
}


def _held_out(
    name: str, variant: Variant, shapes: list[ProbeShape], model, design: list[ProbeShape]
) -> list[dict]:
    """Per held-out shape: the largest relative error of each group of predictions."""
    vm = next(v for v in model.variants if v.variant == variant)
    rows = []
    for shape in shapes:
        assert shape not in design, shape
        checks = check_records(vm, run_probes(probes_for(variant, [shape]), "cpu", progress=False))
        groups = {
            "saved": [c for c in checks if "saved" in c.quantity],
            "transient": [c for c in checks if c.transient],
            "static": [c for c in checks if c.quantity in ("params", "grads", "optimizer")],
        }
        rows.append(
            {
                "variant": name,
                "shape": dataclasses.asdict(shape),
                "checks": len(checks),
                **{f"{g}_max_rel": max(c.rel_error for c in cs) for g, cs in groups.items()},
                "worst": max(checks, key=lambda c: c.rel_error).quantity,
            }
        )
        print(
            f"{name} {shape}: "
            + ", ".join(f"{k} {100 * v:.3f}%" for k, v in rows[-1].items() if k.endswith("rel"))
        )
    return rows


def _loo_rows(vm) -> list[dict]:
    """Per chunk kind and field: the regression's and the replayed timeline's leave-one-out
    error."""
    windows = {(w.kind, w.layers, w.recompute_layers, w.window): w.model for w in vm.windows}
    rows = [
        {
            "quantity": "layer saved S",
            "regression": vm.layer_saved.loo_max_rel_error,
            "timeline": None,
        }
    ]
    for chunk in vm.chunks:
        for field, reg in chunk.fields:
            if field not in FIELDS:
                continue
            layers, rc, window = FIELDS[field]
            model = windows.get((chunk.kind, layers, rc, "forward" if window == KEPT else window))
            timeline = (
                None
                if model is None
                else (model.kept_loo_max_rel_error if window == KEPT else model.loo_max_rel_error)
            )
            rows.append(
                {
                    "quantity": f"{chunk.kind}.{field}",
                    "regression": reg.loo_max_rel_error,
                    "timeline": timeline,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/profile_quality.json")
    ns = ap.parse_args()
    out, held = [], []
    for name, (variant, shapes) in VARIANTS.items():
        design = design_shapes(variant_tps(variant, 4))
        probes = probes_for(variant, design)
        t0 = time.perf_counter()
        records = run_probes(probes, "cpu", progress=True, timelines=True)
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        model = fit(records)
        fit_seconds = time.perf_counter() - t0
        out.append(
            {
                "variant": name,
                "probes": len(probes),
                "seconds": seconds,
                "fit_seconds": fit_seconds,
                "quantities": _loo_rows(next(v for v in model.variants if v.variant == variant)),
            }
        )
        held += _held_out(name, variant, shapes, model, design)
    with open(ns.out, "w") as f:
        json.dump({"variants": out, "held_out": held}, f, indent=1)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
