"""Benchmark: planner speed. The exact partition of 1000 layers over 64 stages, the full search
for GPT-3 175B on 1024 GPUs of 80 GiB (memory model profiled once in fake mode and cached; the
search times exclude it, the end-to-end `capture-megatron plan` time includes loading and fitting),
and profiling Llama-2-70B's own shapes in fake mode (TP 8 + SP, no design shapes; a fresh cache).

    python bench/speed.py [--repeats 7] [--out bench/results/speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from capture_megatron.config import GIB, Cluster, Kernels
from capture_megatron.config.presets import preset
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.partition import min_max_partition
from capture_megatron.planner.search import search
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.supply import needs_of
from capture_megatron.profile.source import profiled_model

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
    min_max_partition(
        1000, 64, 1, lambda r, c: 3.0e8 * c[0] + 1.0e8 * (64 - r) * c[0] + 2.0e9 * (r == 0)
    )


LLAMA2_70B = (
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
    "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--hidden-dropout 0 --attention-dropout 0 --bf16 --seq-length 4096 --vocab-size 32000 "
    "--tensor-model-parallel-size 8 --sequence-parallel --micro-batch-size 1"
).split()


def profile_70b() -> None:
    """`capture-megatron profile` of Llama-2-70B's own shapes, fake device, in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "capture_megatron.cli",
            "profile",
            *LLAMA2_70B,
            "--device",
            "fake",
            "--no-design",
            "--no-progress",
            "--out",
            os.path.join(tmp, "r.jsonl"),
        ]
        subprocess.run(cmd, capture_output=True, check=True)


KERNELS = Kernels()
"""Megatron-LM's default kernels (Transformer Engine, cuDNN fused attention), on fake CUDA."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/speed.json")
    ns = ap.parse_args()
    shape = preset("gpt3-175b")
    cluster = Cluster(gpus=1024, gpu_memory_bytes=80 * GIB)
    plans = list(candidates(shape, cluster, GBS, Space()))
    needs = needs_of(shape, plans)
    t0 = time.perf_counter()
    model = profiled_model(shape, "fake-cuda", KERNELS, needs, progress=True)
    first_profile = time.perf_counter() - t0
    margins = Margins()
    out = {
        "partition_1000_layers_64_stages_s": median_seconds(partition_1000_over_64, ns.repeats),
        "candidates_175b_1024": len(plans),
        "profile_or_load_and_fit_s": first_profile,
    }
    for objective in ("min-peak", "throughput"):
        result = search(model, shape, cluster, GBS, Space(), objective, margins)
        out[f"search_{objective}_s"] = median_seconds(
            lambda objective=objective: search(
                model, shape, cluster, GBS, Space(), objective, margins
            ),
            ns.repeats,
        )
        out[f"search_{objective}_balanced_candidates"] = result.considered
        best = result.ranked[0]
        p = best.plan
        out[f"search_{objective}_best"] = (
            f"TP{p.tp} PP{p.pp} DP{p.dp} VPP{p.vpp} mbs{p.micro_batch_size} "
            f"{p.recompute.granularity} peak {best.peak / GIB:.1f} GiB "
            f"step {best.step_seconds:.2f} s"
        )
    cmd = [
        sys.executable,
        "-m",
        "capture_megatron.cli",
        "plan",
        "--preset",
        "gpt3-175b",
        "--gpus",
        "1024",
        "--gpu-memory-gib",
        "80",
        "--global-batch-size",
        str(GBS),
        "--device",
        "fake",
        "--no-progress",
    ]
    out["cli_end_to_end_s"] = median_seconds(
        lambda: subprocess.run(cmd, capture_output=True, check=True, env=dict(os.environ)), 3
    )
    out["profile_llama2_70b_fake_s"] = median_seconds(profile_70b, 3)
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
