"""Benchmark: today's published models planned with `capture-megatron plan --hf-config` (issue 26,
must-show 3), each on GPUs of 80 GiB at a cluster size where it can fit.

For each published config.json (tests/data/hf_configs, sources in the README there) the command
runs as a user types it, in a fresh process; the row keeps the parameter count the plan prints,
the published count (tests/unit/test_hf_today.py's PUBLISHED), the plan it chose, its worst
rank's predicted need against 80 GiB, and the wall time (cold or warm: whatever this machine's
profile cache holds; the row says which).

    python bench/hf_planned.py [--models Qwen3-8B,...] [--out bench/results/hf_planned.json]

--models reruns only those rows and keeps the others in --out.
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
HF = os.path.join(ROOT, "tests", "data", "hf_configs")
MODELS = {
    "Qwen3-8B": 8,
    "OLMo-2-1124-7B": 8,
    "Qwen3-30B-A3B": 16,
    "DeepSeek-V2-Lite": 8,
    "Moonlight-16B-A3B-Instruct": 8,
    "Qwen3-235B-A22B-Instruct-2507": 256,
    "DeepSeek-V3": 1024,
}
"""Each model and the GPUs it is planned for."""
PUBLISHED = {
    "Qwen3-8B": 8.2e9,
    "OLMo-2-1124-7B": 7.3e9,
    "Qwen3-30B-A3B": 30.5e9,
    "DeepSeek-V2-Lite": 15.7e9,
    "Moonlight-16B-A3B-Instruct": 16e9,
    "Qwen3-235B-A22B-Instruct-2507": 235e9,
    "DeepSeek-V3": 685e9,
}
"""Published totals (model cards; sources in tests/unit/test_hf_today.py)."""


def plan(name: str, gpus: int) -> dict[str, Any]:
    """Plan one model in a fresh process; its row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        argv = [sys.executable, "-m", "capture_megatron.cli", "plan"]
        argv += ["--hf-config", os.path.join(HF, f"{name}.json"), "--gpus", str(gpus)]
        argv += ["--gpu-memory-gib", "80", "--no-progress", "--json", out]
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp)
        seconds = time.perf_counter() - start
        first = (done.stdout.splitlines() or [""])[0]
        count = int(first.split("(")[1].split(")")[0].replace(",", "")) if "(" in first else 0
        row: dict[str, Any] = {"model": name, "gpus": gpus, "exit": done.returncode}
        row |= {"parameters": count, "published": PUBLISHED[name], "seconds": round(seconds, 1)}
        row["cold"] = "profiling" in done.stdout + done.stderr
        if done.returncode != 0 or not os.path.exists(out):
            row["why"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
            return row
        with open(out) as f:
            data = json.load(f)
    p = data["plan"]
    row["plan"] = {k: p.get(k) for k in ("tp", "pp", "dp", "vpp", "cp", "ep", "micro_batch_size")}
    row["recompute"] = p.get("recompute")
    ddp = p.get("ddp", {})
    offload = ddp.get("optimizer_offload_fraction", 1.0) if ddp.get("optimizer_cpu_offload") else 0
    row["optimizer_offload"] = offload
    moved = ddp.get("activation_offload", {})
    on = moved.get("fine_grained_activation_offloading")
    row["activation_offload"] = list(moved.get("offload_modules", [])) if on else []
    row["needed_gib"] = round(data["needed_bytes_per_gpu"] / 2**30, 2)
    row["fits"] = data["fits"]
    row["step_s"] = data.get("estimated_step_seconds")
    return row


def main() -> None:
    """Plan the chosen models and write the rows."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "hf_planned.json"))
    args = ap.parse_args()
    rows: dict[str, Any] = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = {r["model"]: r for r in json.load(f)["rows"]}
    for name in (m for m in args.models.split(",") if m):
        rows[name] = plan(name, MODELS[name])
        print(json.dumps(rows[name]), file=sys.stderr)
    ordered = [rows[m] for m in MODELS if m in rows]
    with open(args.out, "w") as f:
        json.dump({"gpu_memory_gib": 80, "rows": ordered}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
