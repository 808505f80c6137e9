"""Benchmark: what profiling costs and how well the fitted regressions generalise. Profiles the
24 design shapes of each variant on CPU (real megatron-core chunks, exact tensor accounting), fits,
and records probe runs, seconds and every regression's leave-one-out maximum relative error.

    python bench/profile_quality.py [--out bench/results/profile_quality.json]
"""
from __future__ import annotations

import argparse
import json
import time

from capture_megatron.fit import fit
from capture_megatron.fit_cli import quality_rows
from capture_megatron.profile.design import design_shapes, probes_for, variant_tps
from capture_megatron.profile.records import Variant
from capture_megatron.profile.session import run_probes

VARIANTS = {
    "gpt fp32": Variant(dtype="fp32", recompute="none", sequence_parallel=False, swiglu=False,
                        normalization="LayerNorm", position_embedding_type="learned_absolute", add_bias_linear=True,
                        dropout=True, untied=False),
    "llama bf16 sp selective": Variant(dtype="bf16", recompute="selective", sequence_parallel=True, swiglu=True,
                                       normalization="RMSNorm", position_embedding_type="rope",
                                       add_bias_linear=False, dropout=False, untied=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/profile_quality.json")
    ns = ap.parse_args()
    out = []
    for name, variant in VARIANTS.items():
        probes = probes_for(variant, design_shapes(variant_tps(variant, 4)))
        t0 = time.perf_counter()
        records = run_probes(probes, "cpu", progress=True)
        seconds = time.perf_counter() - t0
        rows = quality_rows(fit(records))
        out.append({"variant": name, "probes": len(probes), "seconds": seconds,
                    "quantities": [{"quantity": q, "samples": n, "max_abs_residual_bytes": r, "loo_max_rel": loo}
                                   for _, q, n, r, loo in rows]})
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
