"""Benchmark: planner speed. The exact partition of 1000 layers over 64 stages, and the full search
for GPT-3 175B on 1024 GPUs of 80 GiB (memory model profiled once in fake mode and cached; the
search times exclude it, the end-to-end `capture-megatron plan` time includes loading and fitting).

    python bench/speed.py [--repeats 7] [--out bench/results/speed.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from capture_megatron import planner, presets
from capture_megatron.config import GIB, Cluster
from capture_megatron.profile.source import profiled_model
from capture_megatron.plan.partition import min_max_partition
from capture_megatron.predict import variant_of
from capture_megatron.profile.selection import anchor_shape

GBS = 1536


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def partition_1000_over_64() -> None:
    """Per-rank cost like 1F1B's: static per layer plus (64 - rank) in-flight activations."""
    min_max_partition(1000, 64, 1, lambda r, c: 3.0e8 * c[0] + 1.0e8 * (64 - r) * c[0] + 2.0e9 * (r == 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/speed.json")
    ns = ap.parse_args()
    shape = presets.preset("gpt3-175b")
    cluster = Cluster(gpus=1024, gpu_memory_bytes=80 * GIB)
    plans = list(planner.candidates(shape, cluster, GBS, planner.Space()))
    needs = {(variant_of(shape, p), anchor_shape(shape, p.tp, p.micro_batch_size)) for p in plans}
    t0 = time.perf_counter()
    model = profiled_model(shape, "fake", needs, progress=True)
    first_profile = time.perf_counter() - t0
    need = lambda peak: planner.needed_bytes(peak, cluster, 0.08, 2 * GIB)  # noqa: E731
    out = {"partition_1000_layers_64_stages_s": median_seconds(partition_1000_over_64, ns.repeats),
           "candidates_175b_1024": len(plans), "profile_or_load_and_fit_s": first_profile}
    for objective in ("min-peak", "throughput"):
        result = planner.search(model, shape, cluster, GBS, planner.Space(), objective, need)
        out[f"search_{objective}_s"] = median_seconds(
            lambda: planner.search(model, shape, cluster, GBS, planner.Space(), objective, need), ns.repeats)
        out[f"search_{objective}_balanced_candidates"] = result.considered
        best = result.ranked[0]
        p = best.plan
        out[f"search_{objective}_best"] = (f"TP{p.tp} PP{p.pp} DP{p.dp} VPP{p.vpp} mbs{p.micro_batch_size} "
                                           f"{p.recompute.granularity} peak {best.peak / GIB:.1f} GiB "
                                           f"step {best.step_seconds:.2f} s")
    cmd = [sys.executable, "-m", "capture_megatron.cli", "plan", "--preset", "gpt3-175b", "--gpus", "1024",
           "--gpu-memory-gib", "80", "--global-batch-size", str(GBS), "--device", "fake", "--no-progress"]
    out["cli_end_to_end_s"] = median_seconds(lambda: subprocess.run(cmd, capture_output=True, check=True,
                                                                    env=dict(os.environ)), 3)
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
