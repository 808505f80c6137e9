"""The forecast made without a GPU of every GPU result (issue 52).

For each results directory under bench/results/gpu/ (bench/gpu_h100.py's gpu_h100.json, or the
H200 runs' gpu_h200_dev.json), `predict --device fake-cuda` forecasts every run that trained, with
the run's own flags, on this machine (no GPU: the GPU kernel set on fake CUDA tensors, what a user
without the GPU gets), and writes the forecasts beside the measurements as
forecast_without_gpu.json. bench/report_gpu.py sets them beside the measured peak and the forecast
profiled on the GPU (docs/BENCHMARKS.md, "On a real GPU").

    python bench/gpu_forecast.py [--only DIR,...]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import platform
import sys
import time

from tqdm import tqdm

import capture_megatron
from capture_megatron import __version__
from capture_megatron.megatron import quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "gpu")
OUT = "forecast_without_gpu.json"
"""The file written beside each results file."""


NO_FUSED_ADAM = "no Transformer Engine or Apex"
"""What a run's log (or the H200 file's description) says when the GPU machine had neither TE
nor apex: megatron-core then trains with torch's AdamW (--adam-impl torch)."""


def adam_flags(data: dict) -> list[str]:
    """--adam-impl torch where the GPU machine had no FusedAdam (the environment's fused_adam,
    recorded by bench/gpu_h100.py, or what its logs say), else nothing."""
    env = data.get("environment", {})
    if "fused_adam" in env:
        return [] if env["fused_adam"] else ["--adam-impl", "torch"]
    said = [data.get("what", "")] + [r.get("train_log_tail", "") for r in data["runs"]]
    return ["--adam-impl", "torch"] if any(NO_FUSED_ADAM.lower() in t.lower() for t in said) else []


def measured_runs(path: str) -> list[tuple[str, list[str], int]]:
    """(name, the run's whole flag list, measured peak) of every run in a results file that trained:
    gpu_h100.json's model_flags + each run's flags, or the H200 file's common_flags + flags, with
    --adam-impl torch where that machine had no FusedAdam."""
    with open(path) as f:
        data = json.load(f)
    common = [*(data.get("model_flags") or data.get("common_flags") or []), *adam_flags(data)]
    return [
        (r["name"], [*common, *r["flags"]], r["peak_bytes"])
        for r in data["runs"]
        if r.get("train_rc", 0) == 0 and r.get("peak_bytes")
    ]


def forecast(flags: list[str]) -> tuple[int, str, float]:
    """(worst-rank peak, kernel set, seconds) of `predict --device fake-cuda` for the flags."""
    start = time.perf_counter()
    argv = [*flags, "--gpus", "1", "--device", "fake-cuda", "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        got = json.loads(capture_megatron.predict(argv).to_json())
    seconds = time.perf_counter() - start
    return got["predicted_peak_bytes"][0], got["memory_model"]["kernels"], seconds


def environment() -> dict:
    """This machine and the software that forecast."""
    import megatron.core
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "capture_megatron": __version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
    }


def main() -> None:
    """Forecast every trained run of every results directory (or --only those named)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated directory names (default: all)")
    ns = ap.parse_args()
    quiet.install()  # megatron-core's warnings about TE and apex concern no one here
    files = sorted(glob.glob(os.path.join(RESULTS, "*", "gpu_h*.json")))
    files = [p for p in files if not ns.only or os.path.basename(os.path.dirname(p)) in ns.only]
    env = environment()
    if env["cuda_available"]:
        sys.exit("bench/gpu_forecast.py forecasts without a GPU: run it where there is none")
    for path in files:
        runs = measured_runs(path)
        if not runs:
            continue
        rows = []
        for name, flags, peak in tqdm(runs, desc=os.path.basename(os.path.dirname(path))):
            got, kernels, seconds = forecast(flags)
            rows.append(
                {
                    "name": name,
                    "predicted_peak_bytes": got,
                    "error": (got - peak) / peak,
                    "kernels": kernels,
                    "seconds": round(seconds, 1),
                }
            )
        out = {
            "what": "predict --device fake-cuda (no GPU) of each run trained in "
            + os.path.basename(path),
            "environment": env,
            "runs": rows,
        }
        with open(os.path.join(os.path.dirname(path), OUT), "w") as f:
            json.dump(out, f, indent=1)
        worst = max(rows, key=lambda r: abs(r["error"]))
        print(f"{path}: {len(rows)} runs, worst {100 * worst['error']:+.2f}% ({worst['name']})")


if __name__ == "__main__":
    main()
