"""Benchmark: the memory-balanced plan vs Megatron uniform, Megatron first/last and DeepSpeed
'parameters' for GPT-3 and Llama-2 presets on 8 to 1024 GPUs of 80 GiB, and the fewest GPUs each
approach fits on. Every number is predicted by the memory model profiled here on the GPU kernel set
(fake CUDA: real megatron-core chunks with Megatron-LM's default kernels -- Transformer Engine,
cuDNN fused attention -- under FakeTensorMode at the models' true sizes, bf16, selective
recompute with sequence parallelism, micro-batch 1, distributed optimizer, no interleaving).

    python bench/partitioners.py [--presets gpt3-1.3b,...] [--out bench/results/partitioners.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

from tqdm import tqdm

from capture_megatron.cache import records_path
from capture_megatron.config import GIB, Cluster, Kernels
from capture_megatron.config.kernels import kernel_set
from capture_megatron.config.presets import preset as preset_shape
from capture_megatron.planner.baselines import baselines_for
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.search import balanced, evaluate_plan
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.supply import needs_of
from capture_megatron.profile.source import profiled_model
from capture_megatron.records import read_records
from capture_megatron.steptime.model import Hardware

PRESETS = (
    "gpt3-1.3b",
    "gpt3-2.7b",
    "gpt3-6.7b",
    "gpt3-13b",
    "gpt3-175b",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
)
GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
MIN_GPUS = (1, 2, 4) + tuple(range(8, 1025, 8))  # whole nodes of 8 beyond one node
SPACE = Space(
    vpp=(1,),
    micro_batch_size=(1,),
    recompute=("selective",),
    sequence_parallel=(True,),
    distributed_optimizer=(True,),
)
APPROACHES = ("capture", "uniform", "megatron-first-last", "deepspeed-parameters")
GBS = 1024


KERNELS = Kernels()
"""Megatron-LM's default kernels: Transformer Engine, attention backend auto (cuDNN fused)."""
MARGINS = Margins()
"""CUDA margins: the planner's defaults."""


def approach_peaks(model, shape, plan) -> dict[str, float | None]:
    """Worst-rank peak of each approach's split at the plan's sizes (None: cannot split)."""
    out = {
        "capture": max(
            s.peak
            for s in evaluate_plan(
                model, shape, balanced(model, shape, plan), Cluster(1, 1), Margins(), Hardware()
            ).stages
        )
    }
    for b in baselines_for(model, shape, plan):
        out[b.name] = b.partition.peak if b.partition else None
    return out


def per_cluster(model, shape, gpus: int) -> dict:
    """Each approach's best sizes (lowest peak) on `gpus` GPUs, and CAPTURE's sizes with every
    approach."""
    cluster = Cluster(gpus=gpus, gpu_memory_bytes=80 * GIB)
    best: dict[str, tuple[float, object]] = {}
    at_capture = None
    for plan in candidates(shape, cluster, GBS, SPACE):
        peaks = approach_peaks(model, shape, plan)
        for name, peak in peaks.items():
            if peak is not None and (name not in best or peak < best[name][0]):
                best[name] = (peak, plan)
        if at_capture is None or peaks["capture"] < at_capture[1]["capture"]:
            at_capture = (plan, peaks)
    if at_capture is None:
        return {"gpus": gpus, "unavailable": True}
    plan, peaks = at_capture
    return {
        "gpus": gpus,
        "sizes": f"TP{plan.tp} PP{plan.pp} DP{plan.dp}",
        "at_capture_sizes_gib": {k: (v / GIB if v else None) for k, v in peaks.items()},
        "best_sizes_gib": {k: best[k][0] / GIB for k in best},
        "best_sizes_fit": {k: MARGINS.needed(best[k][0]) <= cluster.gpu_memory_bytes for k in best},
    }


def run(preset: str) -> dict:
    shape = preset_shape(preset)
    plans = [
        p for g in GPUS + MIN_GPUS for p in candidates(shape, Cluster(g, 80 * GIB), GBS, SPACE)
    ]
    needs = needs_of(shape, plans)
    t0 = time.perf_counter()
    model = profiled_model(shape, "fake-cuda", KERNELS, needs, progress=True)
    profile_s = time.perf_counter() - t0
    probes = len(read_records(records_path(shape, "fake-cuda", kernel_set("fake-cuda", KERNELS))))
    rows = [per_cluster(model, shape, g) for g in tqdm(GPUS, desc=preset, leave=False)]
    fewest: dict[str, int | None] = {a: None for a in APPROACHES}
    for g in MIN_GPUS:  # ascending until every approach has fitted once
        fits = per_cluster(model, shape, g).get("best_sizes_fit", {})
        fewest.update({a: g for a in APPROACHES if fewest[a] is None and fits.get(a)})
        if all(fewest.values()):
            break
    return {
        "preset": preset,
        "profile_and_fit_seconds": profile_s,
        "probes": probes,
        "layers": shape.num_layers,
        "rows": rows,
        "min_gpus": fewest,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--out", default="bench/results/partitioners.json")
    ap.add_argument(
        "--reuse-cache",
        action="store_true",
        help="reuse ~/.cache profiles (else time a fresh profile)",
    )
    ns = ap.parse_args()
    if not ns.reuse_cache:
        os.environ["CAPTURE_MEGATRON_CACHE"] = tempfile.mkdtemp(prefix="capture-bench-")
    results = [run(p) for p in ns.presets.split(",")]
    with open(ns.out, "w") as f:
        json.dump(
            {"space": dataclasses.asdict(SPACE), "global_batch_size": GBS, "results": results},
            f,
            indent=1,
        )
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
