"""Train single-GPU plans on a real GPU and record what they measured (issues 26, 28, 30, 31).

Runs where a CUDA device is (the lent H100 of this project's device tool). Back on a machine without
a GPU, `bench/gpu_forecast.py` forecasts the same runs there (the GPU kernel set on fake CUDA
tensors: what a user without the GPU gets) and `bench/report_gpu.py` sets the measured peak, the
forecast profiled on the GPU and the forecast made without it side by side. Every run is Megatron's
local spec (`--transformer-impl local`): Transformer Engine is not installed on that machine and
could not be carried to it (its wheel is 276 MB against the tool's 64 MiB, and its torch extension
builds from source). Each run is `capture-megatron train --nproc 1` under torchrun with NCCL, its
--memory-report giving max_memory_allocated over the training iterations and every step's time; then
`predict --device cuda` (profiled on the same GPU) forecasts the same flags.

    python bench/gpu_h100.py OUT_DIR [--budget-s 420]

GPU_BENCH_EXTRA="--flag value ..." adds flags to every run (bench/gpu_run.sh: the distributed
backend its first training found working).

Writes OUT_DIR/gpu_h100.json after every run, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

NO_EXTENSIONS = [
    "--no-gradient-accumulation-fusion",
    "--no-rope-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
]
"""Megatron-LM's defaults need apex's fused wgrad extension, TE's RoPE kernel and Megatron's fused
softmax extension; none is on the GPU machine, and megatron-core fails without them (as Megatron-LM
would). The lent H100's two runs of 2026-11-26 found them one by one (bench/results/gpu/). The
SwiGLU and bias-dropout fusions are megatron's torch.compile'd functions (megatron/core/jit.py):
Inductor would compile them in every training process, minutes of a 15-minute lease, while the
profile's probes run them eagerly (emulate/eager_jit.py); off, both run the same eager code."""
MODEL = [
    *("--num-layers", "8", "--hidden-size", "2048", "--ffn-hidden-size", "5632"),
    *("--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4"),
    *("--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "32000"),
    *("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"),
    *("--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16"),
    *("--transformer-impl", "local", "--global-batch-size", "16"),
    *("--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"),
    *NO_EXTENSIONS,
]
"""A Llama-style 0.56B-parameter model, 8 layers: small enough to start fast, large enough that
activations, not set-up buffers, decide the peak."""
TINY = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "512"),
    *("--bf16", "--transformer-impl", "local", "--global-batch-size", "8", *NO_EXTENSIONS),
]
"""The dry run's model (GPU_BENCH_TINY=1, on the CPU): checks this script, measures nothing."""
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
OFFLOAD = [
    "--use-distributed-optimizer",
    "--use-precision-aware-optimizer",
    "--optimizer-cpu-offload",
]
CONFIGS: list[tuple[str, str, list[str]]] = [
    ("mbs2-none", "28", ["--micro-batch-size", "2"]),
    *(
        (
            f"mbs2-offload-{f}",
            "31",
            ["--micro-batch-size", "2", *OFFLOAD, "--optimizer-offload-fraction", f],
        )
        for f in ("0", "0.5", "1")
    ),
    ("mbs4-none", "28", ["--micro-batch-size", "4"]),
    ("mbs4-full", "28", ["--micro-batch-size", "4", *FULL, "--recompute-num-layers", "1"]),
    ("mbs2-qk-layernorm", "26", ["--micro-batch-size", "2", "--qk-layernorm"]),
    ("mbs1-none", "28", ["--micro-batch-size", "1"]),
    ("mbs1-full", "28", ["--micro-batch-size", "1", *FULL, "--recompute-num-layers", "1"]),
    ("mbs2-full", "28", ["--micro-batch-size", "2", *FULL, "--recompute-num-layers", "1"]),
]
"""(name, issue, flags beyond MODEL): micro-batch 1/2/4 with recompute off and on (issue 28), QK
layernorm (issue 26), optimizer CPU offload at fractions 0, 1/2 and 1 (issue 31). In the order a
short lease should spend its minutes: the offload fractions beside the same plan without them
first."""
ITERS = 6
"""Training iterations per run; the step time is the median of the last ITERS - 2."""
GRACE_S = 60.0
"""How long the last run may outlast --budget-s before it is stopped (the lease is short)."""


def _cli(args: list[str], timeout: float) -> tuple[int, float, str]:
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "capture_megatron.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = 124, f"timed out after {timeout} s: {e.stdout!r} {e.stderr!r}"
    return rc, time.perf_counter() - start, log


def _train(name: str, flags: list[str], out: str, timeout: float) -> dict:
    report = os.path.join(out, f"report-{name}.json")
    run = ["--mock-data", "--train-iters", str(ITERS), "--no-progress", "--memory-report", report]
    rc, wall, log = _cli(["train", "--nproc", "1", *flags, *run], timeout=min(180, timeout))
    row: dict = {"train_rc": rc, "train_wall_s": round(wall, 1), "train_log_tail": log[-1500:]}
    if rc != 0:  # the rank's own error comes before torchrun's report: keep the whole log
        with open(os.path.join(out, "train-failed.log"), "w") as f:
            f.write(log)
        errors = [ln for ln in log.splitlines() if "Error" in ln or "error:" in ln]
        row["train_error"] = errors[0] if errors else ""
    if rc == 0 and os.path.exists(report):
        with open(report) as f:
            rep = json.load(f)
        os.remove(report)  # folded into the one results file (the tool returns at most 8 files)
        (rank,) = rep["ranks"]
        steps = [it["step_seconds"] for it in rep["iterations"]]
        row.update(
            device=rep["device"],
            peak_bytes=rank["peak_bytes"],
            reserved_bytes=rank.get("reserved_bytes", 0),
            setup_bytes=rank["setup_bytes"],
            optimizer_device_bytes=rank.get("optimizer_device_bytes", 0),
            optimizer_host_bytes=rank.get("optimizer_host_bytes", 0),
            step_seconds=steps,
            step_seconds_median=statistics.median(steps[2:] or steps),
            losses=[it["loss"] for it in rep["iterations"]],
        )
    return row


def _predict(name: str, flags: list[str], out: str, device: str, timeout: float) -> dict:
    path = os.path.join(out, f"predict-{name}.json")
    run = ["--gpus", "1", "--device", device, "--no-progress", "--json", path]
    rc, wall, log = _cli(["predict", *flags, *run], timeout=min(240, timeout))
    row: dict = {"predict_rc": rc, "predict_wall_s": round(wall, 1)}
    if rc != 0:
        row["predict_log_tail"] = log[-1500:]
    elif os.path.exists(path):
        with open(path) as f:
            got = json.load(f)
        os.remove(path)
        row.update(
            predicted_peak_bytes=got["predicted_peak_bytes"][0],
            estimated_step_seconds=got.get("estimated_step_seconds"),
        )
    return row


def _environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__}
    # megatron-core's optimizer is TE's or apex's FusedAdam when either imports, else torch's
    # AdamW (bench/gpu_forecast.py forecasts with --adam-impl torch then)
    from capture_megatron.megatron.extensions import FUSED_ADAM, found_module

    env["fused_adam"] = any(found_module(m) for m in FUSED_ADAM)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_bytes=p.total_memory)
    try:
        import megatron.core

        env["megatron_core"] = megatron.core.__version__
    except ImportError as e:
        env["megatron_core"] = f"missing: {e}"
    return env


def _save(results: dict, path: str, phase: str = "", row: dict | None = None) -> None:
    """Write the results file (after every run, so a run cut short keeps what it measured), and
    print the run's line."""
    if row is not None:
        shown = {k: v for k, v in row.items() if "log" not in k}
        print(f"{phase} {row['name']}: " + json.dumps(shown), flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def _train_phase(
    results: dict, configs: list, ns: argparse.Namespace, start: float, path: str
) -> bool:
    """Train each configuration until --train-budget-s is spent; False when the first failed
    (every run shares the model's flags: the rest are not tried, leaving the lease for a retry)."""
    model = results["model_flags"]
    for name, issue, extra in configs:
        spent = time.perf_counter() - start
        if spent > ns.train_budget_s:
            results["stopped_train"] = f"budget spent ({spent:.0f} s) before train {name}"
            break
        timeout = ns.budget_s + GRACE_S - spent
        row = {"name": name, "issue": issue, "flags": extra}
        row.update(_train(name, [*model, *extra], ns.out, timeout))
        results["runs"].append(row)
        first_failed = row["train_rc"] != 0 and len(results["runs"]) == 1
        if first_failed:
            results["stopped_train"] = f"the first training failed (rc {row['train_rc']})"
        _save(results, path, "train", row)
        if first_failed:
            print(row.get("train_error") or row["train_log_tail"], flush=True)
            return False
    return True


def _predict_phase(
    results: dict, device: str, ns: argparse.Namespace, start: float, path: str, trained: bool
) -> None:
    """Forecast the runs trained, in order, until --budget-s is spent (only the first when the
    first training failed)."""
    model, runs = results["model_flags"], results["runs"]
    if not trained:
        results["stopped_predict"] = "after the first: training failed"
        runs = runs[:1]
    for row in runs:
        spent = time.perf_counter() - start
        if spent > ns.budget_s:
            name = row["name"]
            results["stopped_predict"] = f"budget spent ({spent:.0f} s) before predict {name}"
            break
        timeout = ns.budget_s + GRACE_S - spent
        row.update(_predict(row["name"], [*model, *row["flags"]], ns.out, device, timeout))
        _save(results, path, "predict", row)


def main() -> None:
    """Run every configuration in order until the budget is spent; write the results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new run after this")
    ap.add_argument(
        "--train-budget-s", type=float, default=300.0, help="no new training after this"
    )
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ns = ap.parse_args()
    configs = [c for c in CONFIGS if not ns.only or c[0] in ns.only.split(",")]
    os.makedirs(ns.out, exist_ok=True)
    tiny = os.environ.get("GPU_BENCH_TINY") == "1"
    model, device = (TINY, "cpu") if tiny else (MODEL, "cuda")
    model = [*model, *os.environ.get("GPU_BENCH_EXTRA", "").split()]
    start = time.perf_counter()
    results = {"environment": _environment(), "model_flags": model, "iterations": ITERS, "runs": []}
    path = os.path.join(ns.out, "gpu_h100.json")
    # trains first (what only the GPU can give), then the forecasts profiled on that GPU
    trained = _train_phase(results, configs, ns, start, path)
    _predict_phase(results, device, ns, start, path, trained)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    _save(results, path)


if __name__ == "__main__":
    main()
