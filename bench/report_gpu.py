"""The "On a real GPU" section of docs/BENCHMARKS.md (from bench/results/gpu/*/gpu_h100.json,
written by bench/gpu_h100.py on a lent GPU; see bench/report.py). Rows that trained show the
measured peak (max_memory_allocated) and step against `predict --device cuda`'s forecast and the
step-time estimate; runs that did not train show why, in Megatron-Core's or capture-megatron's
words (the model's flags at the time are in each results file)."""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
from typing import Any

GIB = 1 << 30


def _why(log: str) -> str:
    """The last line of a log that names an exception, or ''."""
    found = re.findall(r"(\w+Error|error): ([^\n|]*)", log or "")
    if not found:
        return ""
    kind, text = found[-1]
    text = text.strip()
    return f"{kind}: {'...' + text[-110:] if len(text) > 110 else text}".replace("|", "/")


def _failed(data: dict[str, Any]) -> str:
    """One sentence for runs that did not train: the distinct reasons the logs name."""
    reasons = []
    for r in data["runs"]:
        for log in (r.get("train_log_tail", ""), r.get("predict_log_tail", "")):
            why = _why(log)
            if why and "ChildFailedError" not in why and why not in reasons:
                reasons.append(why)
    failed = [r["name"] for r in data["runs"] if r.get("train_rc") != 0]
    return (
        f"{len(failed)} of {len(data['runs'])} runs did not train; the logs name: "
        + ("; ".join(f"`{w}`" for w in reasons) or "no exception (see the logs)")
        + "."
    )


def _row(r: dict[str, Any]) -> str:
    peak, got = r["peak_bytes"], r.get("predicted_peak_bytes")
    err = f"{100 * (got - peak) / peak:+.2f}%" if got else "no forecast"
    forecast = f"{got / GIB:.2f}" if got else "-"
    step = r.get("estimated_step_seconds")
    est = f"{step:.3f}" if step else "-"
    device, host = r.get("optimizer_device_bytes", 0), r.get("optimizer_host_bytes", 0)
    split = f"{device / GIB:.2f} / {host / GIB:.2f}" if device or host else "-"
    return (
        f"| {r['name']} | `{' '.join(r['flags'])}` | {peak / GIB:.2f} | {forecast} | {err} | "
        f"{split} | {r['step_seconds_median']:.3f} / {est} | {r['losses'][-1]:.4f} |"
    )


def _note(path: str) -> list[str]:
    """The run's note.md (what the results file cannot say), if any."""
    note = os.path.join(os.path.dirname(path), "note.md")
    if not os.path.exists(note):
        return []
    with open(note) as f:
        return ["", " ".join(f.read().split())]


def _summary(results: list[dict[str, Any]]) -> list[str]:
    """One sentence over every run that trained and was forecast: how many, worst and median
    error."""
    errors = [
        100 * (r["predicted_peak_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
        for data in results
        for r in data["runs"]
        if r.get("train_rc") == 0 and r.get("predicted_peak_bytes")
    ]
    if not errors:
        return []
    worst = max(errors, key=abs)
    return [
        "",
        f"**In all:** {len(errors)} runs trained and forecast; the forecast's worst error "
        f"{worst:+.2f}%, median {statistics.median(errors):+.2f}%.",
    ]


def gpu_sections(root: str) -> str:
    """The section, or '' when no GPU run has been recorded."""
    paths = sorted(glob.glob(os.path.join(root, "bench/results/gpu/*/gpu_h100.json")))
    if not paths:
        return ""
    out = [
        "\n\n## On a real GPU (bench/gpu_h100.py, run by bench/gpu_run.sh on a lent GPU)\n",
        "Single-GPU training runs of a Llama-style 8-layer model (the local spec: Transformer "
        "Engine cannot be installed there), each `capture-megatron train --nproc 1` with "
        "`--memory-report`, beside `predict --device cuda` of the same flags. Columns: measured "
        "peak GiB (max_memory_allocated over the training iterations), forecast GiB, error, the "
        "optimizer state HybridDeviceOptimizer placed on the GPU and in host memory (optimizer "
        "offload runs), the median measured step / the step-time model's estimate in seconds "
        "(the model is calibrated on Transformer Engine runs; these run the local spec), and the "
        "loss at the last iteration.",
    ]
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    out += _summary(results)
    for path, data in zip(paths, results):
        env = data["environment"]
        name = os.path.basename(os.path.dirname(path))
        trained = [r for r in data["runs"] if r.get("train_rc") == 0]
        out += [
            "",
            f"**{name}**: {env.get('gpu', 'no GPU')}, torch {env['torch']}, megatron-core "
            f"{env['megatron_core']}, {data.get('wall_s', '?')} s. "
            + (_failed(data) if len(trained) < len(data["runs"]) else ""),
        ]
        out += _note(path)
        if trained:
            out += [
                "",
                "| run | flags | measured GiB | forecast GiB | error | optimizer GiB GPU / host "
                "| step s measured / est. | last loss |",
                "|---|---|---|---|---|---|---|---|",
                *(_row(r) for r in trained),
            ]
    return "\n".join(out) + "\n"
