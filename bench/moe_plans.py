"""Plans for mixture-of-experts models at scale (issue 16): Mixtral-8x7B (its published
config.json) on 16 x 80 GiB and a DeepSeek-V3-sized MoE on 1024 x 80 GiB, the memory-balanced
layout against the uniform split and the other systems' splits at the same sizes. Memory model:
the GPU kernel set (fake-cuda: Transformer Engine's modules, the experts as TE's grouped GEMM).
Selective recompute is fixed (Megatron-LM's usual setting for these models): with full recompute,
which the min-peak objective would pick, the activations nearly vanish and with them the imbalance.
Writes bench/results/moe_plans.json (rendered by bench/report.py).

python bench/moe_plans.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUTING = (
    "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 "
    "--moe-pad-expert-input-to-capacity --moe-grouped-gemm --bf16 --micro-batch-size 1 "
    "--recompute-granularity selective"
)
MIXTRAL = (
    f"--hf-config {ROOT}/tests/data/hf_configs/Mixtral-8x7B-v0.1.json --seq-length 4096 "
    f"--global-batch-size 256 {ROUTING}"
)
# DeepSeek-V3's sizes (61 layers, h 7168, 256 routed experts of 2048 top-8, one shared expert,
# vocabulary 129280, the first three layers dense as its first_k_dense_replace) with grouped-query
# attention in place of MLA (refused)
DEEPSEEK_V3_SIZED = (
    "--num-layers 61 --moe-layer-freq ([0]*3+[1]*58) --hidden-size 7168 "
    "--num-attention-heads 128 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 18432 --num-experts 256 --moe-router-topk 8 "
    "--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --seq-length 4096 "
    "--max-position-embeddings 4096 --vocab-size 129280 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    f"--global-batch-size 8192 {ROUTING} --tensor-model-parallel-size 2 --sequence-parallel "
    "--expert-model-parallel-size 32 --pipeline-model-parallel-size 16"
)
CASES = (("Mixtral-8x7B", MIXTRAL, 16), ("DeepSeek-V3-sized", DEEPSEEK_V3_SIZED, 1024))


def _plan(flags: str, gpus: int, cwd: str) -> dict:
    out = os.path.join(cwd, "plan.json")
    exe = os.path.join(os.path.dirname(sys.executable), "capture-megatron")
    argv = [exe, "plan", *flags.split(), "--gpus", str(gpus), "--gpu-memory-gib", "80"]
    argv += ["--device", "fake-cuda", "--objective", "min-peak", "--json", out]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as cwd:
        for name, flags, gpus in CASES:
            start = time.perf_counter()
            data = _plan(flags, gpus, cwd)
            plan = data["plan"]
            rows.append(
                {
                    "model": name,
                    "gpus": gpus,
                    "flags": flags.replace(ROOT + "/", ""),
                    "plan": plan,
                    "peaks_gib": [b / 2**30 for b in data["predicted_peak_bytes"]],
                    "baselines": {
                        name: (
                            {
                                "layers": b["layers_per_stage"],
                                "peaks_gib": [x / 2**30 for x in b["predicted_peak_bytes"]],
                            }
                            if "unavailable" not in b
                            else {"unavailable": b["unavailable"]}
                        )
                        for name, b in data["baselines"].items()
                    },
                    "notes": data.get("notes", []),
                    "seconds": time.perf_counter() - start,
                }
            )
            print(f"{name}: {plan['layout']} {max(rows[-1]['peaks_gib']):.2f} GiB")
    with open(os.path.join(ROOT, "bench/results/moe_plans.json"), "w") as f:
        model = "the GPU kernel set (fake CUDA, TE's grouped GEMM experts)"
        json.dump({"memory_model": model, "rows": rows}, f, indent=1)
    print("wrote bench/results/moe_plans.json")


if __name__ == "__main__":
    main()
