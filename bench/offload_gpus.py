"""Benchmark (issue 31, must-show 1): the fewest GPUs of 80 GiB each model fits on, without and with
offload, and the estimated slowdown: fine-grained activation offloading (its module sets searched)
and optimizer CPU offload (--optimizer-cpu-offload, the fraction searched: 0, 1/4, 1/2, 3/4, 1).
Each model is planned three times as a user types it, in a fresh process:
`capture-megatron plan ... --objective min-gpus`, with `--optimizer-offload-fraction 0
--no-activation-offload` (no offload), with `--optimizer-offload-fraction 0` (activations only)
and with both left to the planner (SETTINGS); on the GPU kernel set (fake
CUDA: Transformer Engine, cuDNN fused attention), bf16, with the small fixed space of
bench/partitioners.py (micro-batch 1, selective recompute with sequence parallelism, the
distributed optimizer, no interleaving, CP 1), global batch 1024, the planner's CUDA margins and
the h100-sxm hardware profile (2 TiB of host memory per node of 8 GPUs).

Models: Llama-2-70B (the llama2-70b preset), Llama 3.1 405B (Meta's config.json for
meta-llama/Llama-3.1-405B: 126 layers, hidden 16384, FFN 53248, 128 heads, 8 KV heads, vocabulary
128256; sequence 8192) and a DeepSeek-V3-sized model: DeepSeek-V3 itself
(tests/data/hf_configs/DeepSeek-V3.json, sequence 4096; `--models deepseek-v3`), whose cold profile
did not finish its first round in 18 minutes on a shared 2-core CPU, or a dense model of its 671B
parameters (`deepseek-v3-dense`, the default).

    nice python bench/offload_gpus.py [--models llama2-70b,...] [--limit 1024]
        [--out bench/results/offload_gpus.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXED = (
    "--micro-batch-size 1 --recompute-granularity selective --sequence-parallel "
    "--use-distributed-optimizer --num-virtual-stages-per-pipeline-rank 1 "
    "--context-parallel-size 1 --global-batch-size 1024 --gpu-memory-gib 80"
).split()
"""The small fixed space (bench/partitioners.py's) and the cluster."""
LLAMA31_405B = (
    "--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 "
    "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
    "--vocab-size 128256 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
    "--bf16"
).split()
"""Llama 3.1 405B as Megatron-LM flags (meta-llama/Llama-3.1-405B config.json)."""
DENSE_671B = (
    "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 500736 --num-attention-heads 128 "
    "--seq-length 4096 --max-position-embeddings 4096 --vocab-size 129280 --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --bf16"
).split()
"""A dense model of DeepSeek-V3's size: its 61 layers, hidden 7168, 128 heads, vocabulary 129280
and sequence 4096, one dense SwiGLU MLP per layer sized for 671.2B parameters (DeepSeek-V3's
671B main model; its multi-token prediction module left out)."""
MODELS: dict[str, tuple[str, list[str]]] = {
    "llama2-70b": ("preset llama2-70b", ["--preset", "llama2-70b"]),
    "llama3.1-405b": ("meta-llama/Llama-3.1-405B config.json", LLAMA31_405B),
    "deepseek-v3": (
        "tests/data/hf_configs/DeepSeek-V3.json",
        ["--hf-config", os.path.join(ROOT, "tests/data/hf_configs/DeepSeek-V3.json")]
        + ["--seq-length", "4096"],
    ),
    "deepseek-v3-dense": (
        "a dense model of DeepSeek-V3's 671B parameters (61 layers, hidden 7168, FFN 500736)",
        DENSE_671B,
    ),
}
"""Name -> (source, the model's flags)."""


SETTINGS = {
    "without": ["--optimizer-offload-fraction", "0", "--no-activation-offload"],
    "activations": ["--optimizer-offload-fraction", "0"],
    "with": [],
}
"""The three runs of a model: no offload; fine-grained activation offloading's module sets
searched, the optimizer kept on the GPUs; both searched (the planner's default)."""


def plan(flags: list[str], limit: int, setting: str, cache: str) -> dict[str, Any]:
    """min-gpus for one model in a fresh process with one of SETTINGS; its row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        argv = [sys.executable, "-m", "capture_megatron.cli", "plan", *flags, *FIXED]
        argv += ["--gpus", str(limit), "--objective", "min-gpus", "--no-progress", "--json", out]
        argv += SETTINGS[setting]
        env = {**os.environ, "CAPTURE_MEGATRON_CACHE": cache}
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=env)
        row: dict[str, Any] = {"seconds": round(time.perf_counter() - start, 1)}
        if done.returncode != 0 or not os.path.exists(out):
            lines = done.stderr.strip().splitlines()
            return row | {"exit": done.returncode, "why": lines[-1] if lines else ""}
        with open(out) as f:
            data = json.load(f)
    return row | _summary(data)


def _summary(data: dict[str, Any]) -> dict[str, Any]:
    """What the table shows of a plan JSON."""
    p = data["plan"]
    gpus = p["tp"] * p["pp"] * p["dp"] * p["cp"]
    ddp = p["ddp"]
    fraction = ddp.get("optimizer_offload_fraction", 1.0) if ddp.get("optimizer_cpu_offload") else 0
    host = max(
        (s.get("host", 0) + s.get("activation_host", 0) for s in data["breakdown"]), default=0
    )
    moved = ddp.get("activation_offload", {})
    groups = (
        moved.get("offload_modules", []) if moved.get("fine_grained_activation_offloading") else []
    )
    return {
        "exit": 0,
        "gpus": gpus,
        "plan": {k: p[k] for k in ("tp", "pp", "dp", "ep", "micro_batch_size")},
        "offload_fraction": fraction,
        "activation_offload": list(groups),
        "recompute": p["recompute"]["granularity"],
        "needed_gib": round(data["needed_bytes_per_gpu"] / 2**30, 2),
        "step_s": data["estimated_step_seconds"],
        "host_gib_per_node": round(min(8, gpus) * host / 2**30, 1),
        "notes": [n for n in data["notes"] + data["reasoning"] if "offload" in n],
    }


def main() -> None:
    """Plan each model without and with offload; write the rows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama2-70b,llama3.1-405b,deepseek-v3-dense")
    ap.add_argument("--limit", type=int, default=2048, help="--gpus: the most GPUs tried")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/offload_gpus.json"))
    ap.add_argument("--cache", default=os.environ.get("CAPTURE_MEGATRON_CACHE", ""))
    ns = ap.parse_args()
    cache = ns.cache or tempfile.mkdtemp(prefix="capture-offload-")
    old = {}
    if os.path.exists(ns.out):
        with open(ns.out) as f:
            old = {r["model"]: r for r in json.load(f)["rows"]}
    for name in ns.models.split(","):
        source, flags = MODELS[name]
        old[name] = {"model": name, "source": source, "limit": ns.limit}
        for setting in SETTINGS:  # the first run profiles (cold)
            old[name][setting] = plan(flags, ns.limit, setting, cache)
        print(json.dumps(old[name]), flush=True)
        result = {"fixed": " ".join(FIXED), "rows": [old[m] for m in MODELS if m in old]}
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
