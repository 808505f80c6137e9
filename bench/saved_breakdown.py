"""Benchmark: what one GPT transformer layer saves for backward, tensor by tensor, next to
Korthikanti et al. (2022)'s 34·s·b·h + 5·a·s²·b (16-bit, per layer; /t with sequence parallelism).

Profiles a middle chunk of one layer (bf16, megatron-core's local spec, dropout on) on the 24 CPU
design shapes with allocation timelines, for recompute none / selective x SP off / on (and a Llama
layer, selective + SP); aligns the forward windows (capture_megatron.fit.timelines.align) and fits
every tensor the forward leaves allocated on the size terms
(capture_megatron.fit.timelines.peaks.kept_events), with the shape conditions under which each is
kept. Totals are grouped at GPT-3 proportions (f = 4h, a·d = h, g = a) for the tensors kept at GPT-3
1.3B's shape with TP 8 and b = 1 (REFERENCE).

    python bench/saved_breakdown.py [--out bench/results/saved_breakdown.json]
"""

from __future__ import annotations

import argparse
import json
import time

from capture_megatron.fit import sizes_of
from capture_megatron.fit.terms import Sizes
from capture_megatron.fit.timelines.peaks import kept_events
from capture_megatron.profile.design import design_shapes, variant_tps
from capture_megatron.profile.session import run_probes
from capture_megatron.records import Probe, Variant

ARCHS = {
    "gpt": dict(
        dtype="bf16",
        swiglu=False,
        normalization="LayerNorm",
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        dropout=True,
        untied=False,
    ),
    "llama": dict(
        dtype="bf16",
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        dropout=False,
        untied=True,
    ),
}
GROUPS = {
    "b*s*h": ("sbh", 1),
    "b*s*h/t": ("sbh/t", 1),
    "b*s*a*d/t": ("sbh/t", 1),
    "b*s*g*d/t": ("sbh/t", 1),
    "b*s*f/t": ("sbh/t", 4),
    "b*a*s^2/t": ("as2b/t", 1),
}
"""Term -> (group, multiple of the group's unit at GPT-3 proportions f = 4h, a·d = h, g = a)."""
REFERENCE = Sizes(b=1, s=2048, h=2048, a=16, g=16, d=128, f=8192, V=51200, t=8)
"""GPT-3 1.3B, TP 8, micro-batch 1: which shape conditions hold for the totals."""


def _formula(terms, coefficients) -> str:
    return " + ".join(f"{c:g}·{t}" for t, c in zip(terms, coefficients)) or "0"


def breakdown(arch: str, recompute: str, sp: bool) -> dict:
    """The kept tensors of one setting and their grouped totals (GPT-3 proportions)."""
    variant = Variant(recompute=recompute, sequence_parallel=sp, **ARCHS[arch])
    shapes = design_shapes(variant_tps(variant, 4))
    records = run_probes(
        [Probe(variant, s, "middle", 1, 0) for s in shapes], "cpu", progress=False, timelines=True
    )
    events = kept_events([sizes_of(r) for r in records], [r.timeline("forward") for r in records])
    tensors, totals = [], {"sbh": 0.0, "sbh/t": 0.0, "as2b/t": 0.0, "other": 0.0}
    for e in events:
        tensors.append(
            {
                "op": e.op[1:],
                "bytes": _formula(e.terms, e.coefficients),
                "at_reference": e.happens(REFERENCE),
                "when": " & ".join(e.when)
                + (f" unless {' & '.join(e.unless)}" if e.unless else ""),
            }
        )
        for t, c in zip(e.terms, e.coefficients) if e.happens(REFERENCE) else ():
            group, unit = GROUPS.get(t, ("other", 1))
            totals[group] += c * unit
    return {"arch": arch, "recompute": recompute, "sp": sp, "tensors": tensors, "totals": totals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/saved_breakdown.json")
    ns = ap.parse_args()
    out = []
    for arch, recompute, sp in (
        ("gpt", "none", False),
        ("gpt", "none", True),
        ("gpt", "selective", False),
        ("gpt", "selective", True),
        ("llama", "selective", True),
    ):
        t0 = time.perf_counter()
        out.append(breakdown(arch, recompute, sp))
        print(f"{arch} {recompute} sp={sp}: {out[-1]['totals']} ({time.perf_counter() - t0:.0f} s)")
        for t in out[-1]["tensors"]:
            print(f"   {t['op']:32s} {t['bytes']:40s} {t['at_reference']!s:6s} {t['when']}")
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
