"""Benchmark: the planner's MoE plans beside NVIDIA's configurations for the same model, GPUs and
global batch (issue 51, must-show 3).

NVIDIA's configurations: Megatron-Bridge v0.3.1's H100 BF16 pre-training recipes (tests/data/
megatron_bridge: Qwen3-30B-A3B on 16, Qwen3-235B-A22B on 256, DeepSeek-V3 on 1024 GPUs). For each,
`capture-megatron plan` gets the recipe's line without its parallel sizes, micro-batch, recompute
and pipeline split (STRIPPED: left to the search; everything else, the dispatcher included, kept)
on its GPUs (80 GB H100s), with `--compare-with` the recipe's own line: the step-time model's
estimate of both, and where the time goes side by side when the plan claims more than 15% over
NVIDIA's configuration. Writes bench/results/moe_vs_nvidia.json (rendered by bench/report.py).

    python bench/moe_vs_nvidia.py [--device fake] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = (
    ("Qwen3-30B-A3B", "megatron_bridge/qwen3_30b_a3b_h100_bf16.args", 16),
    ("Qwen3-235B-A22B", "megatron_bridge/qwen3_235b_a22b_h100_bf16.args", 256),
    ("DeepSeek-V3", "megatron_bridge/deepseek_v3_h100_bf16.args", 1024),
)
"""(model, NVIDIA's line under tests/data, its world size)."""
STRIPPED = {
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--expert-model-parallel-size": 1,
    "--expert-tensor-parallel-size": 1,
    "--context-parallel-size": 1,
    "--num-virtual-stages-per-pipeline-rank": 1,
    "--num-layers-per-virtual-pipeline-stage": 1,
    "--pipeline-model-parallel-layout": 1,
    "--decoder-first-pipeline-num-layers": 1,
    "--decoder-last-pipeline-num-layers": 1,
    "--micro-batch-size": 1,
    "--recompute-granularity": 1,
    "--recompute-method": 1,
    "--recompute-num-layers": 1,
    "--recompute-modules": -1,
    "--sequence-parallel": 0,
    "--account-for-embedding-in-pipeline-split": 0,
    "--account-for-loss-in-pipeline-split": 0,
}
"""The flags left to the search, with the values each takes (-1: every word up to the next flag)."""


def strip(words: list[str]) -> list[str]:
    """The line without STRIPPED flags (and their values)."""
    out, i = [], 0
    while i < len(words):
        name = words[i].split("=", 1)[0]
        if name not in STRIPPED:
            out.append(words[i])
            i += 1
            continue
        n = STRIPPED[name] if "=" not in words[i] else 0
        i += 1
        if n < 0:
            while i < len(words) and not words[i].startswith("--"):
                i += 1
        else:
            i += n
    return out


SIZES = {
    "--tensor-model-parallel-size": "tp",
    "--pipeline-model-parallel-size": "pp",
    "--num-virtual-stages-per-pipeline-rank": "vpp",
    "--expert-model-parallel-size": "ep",
    "--expert-tensor-parallel-size": "etp",
    "--context-parallel-size": "cp",
    "--micro-batch-size": "mbs",
    "--global-batch-size": "gbs",
    "--recompute-granularity": "recompute",
    "--moe-token-dispatcher-type": "dispatcher",
}
"""The sizes of NVIDIA's line the report shows."""


def sizes(words: list[str]) -> dict[str, str]:
    """What NVIDIA's line sets of SIZES (and its recompute modules)."""
    out = {key: words[i + 1] for i, w in enumerate(words[:-1]) if (key := SIZES.get(w))}
    if "--recompute-modules" in words:
        rest = words[words.index("--recompute-modules") + 1 :]
        out["modules"] = " ".join(
            rest[: next((i for i, w in enumerate(rest) if w[:2] == "--"), None)]
        )
    return out


def run_case(name: str, path: str, gpus: int, device: str, tmp: str) -> dict:
    """Plan the model of NVIDIA's line on its GPUs, compared with the line."""
    line = os.path.join(ROOT, "tests", "data", path)
    with open(line) as f:
        words = shlex.split(f.read().replace("\\\n", " "), comments=True)
    out = os.path.join(tmp, f"{name}.json")
    exe = os.path.join(os.path.dirname(sys.executable), "capture-megatron")
    argv = [exe, "plan", *strip(words), "--gpus", str(gpus), "--gpu-memory-gib", "80"]
    argv += ["--compare-with", line, "--json", out, "--no-progress"]
    argv += ["--device", device] if device else []
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=7200)
    seconds = time.perf_counter() - start
    if done.returncode:
        reason = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["(no output)"]
        return {
            "model": name,
            "gpus": gpus,
            "nvidia": path,
            "refused": reason[0],
            "seconds": seconds,
        }
    with open(out) as f:
        data = json.load(f)
    lines = done.stdout.splitlines()
    start = next((i for i, x in enumerate(lines) if "side by side" in x), len(lines))
    side = [x for x in lines[start + 1 :] if x.startswith("  ")]
    return {
        "model": name,
        "gpus": gpus,
        "nvidia": path,
        "nvidia_sizes": sizes(words),
        "plan": data["plan"],
        "megatron_args": data["megatron_args"],
        "peak_gib": max(data["predicted_peak_bytes"]) / 2**30,
        "compared_with": data["compared_with"],
        "side_by_side": side if data["compared_with"]["outpaces"] else [],
        "seconds": seconds,
    }


def main() -> None:
    """Run the cases, write the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="")
    p.add_argument("--only", default="")
    args = p.parse_args()
    result = os.path.join(ROOT, "bench", "results", "moe_vs_nvidia.json")
    rows = []
    if args.only and os.path.exists(result):
        with open(result) as f:
            rows = [r for r in json.load(f)["rows"] if r["model"] != args.only]
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, gpus in CASES:
            if args.only and name != args.only:
                continue
            row = run_case(name, path, gpus, args.device, tmp)
            rows.append(row)
            print(name, row.get("refused") or row["compared_with"], flush=True)
    order = [c[0] for c in CASES]
    rows.sort(key=lambda r: order.index(r["model"]))
    with open(result, "w") as f:
        json.dump({"device": args.device or "default", "rows": rows}, f, indent=1)
    print(f"wrote {result}")


if __name__ == "__main__":
    main()
