"""The "On a real GPU" section of docs/BENCHMARKS.md (from bench/results/gpu/*/gpu_h100.json,
written by bench/gpu_h100.py on a lent GPU, and gpu_h200_dev.json, the H200 runs of issue 52; see
bench/report.py). Rows that trained show the measured peak (max_memory_allocated) beside the
forecast profiled on that GPU (`predict --device cuda`) and the forecast made without a GPU
(`predict --device fake-cuda` on a CPU machine: forecast_without_gpu.json, written by
bench/gpu_forecast.py), and the measured step against the step-time estimate; runs that did not
train show why, in Megatron-Core's or capture-megatron's words (the model's flags at the time are
in each results file)."""

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


def _error(got: int | None, peak: int) -> str:
    """'GiB (error)' of a forecast, or '-'."""
    return f"{got / GIB:.2f} ({100 * (got - peak) / peak:+.2f}%)" if got else "-"


def _row(r: dict[str, Any], without: dict[str, int]) -> str:
    peak = r["peak_bytes"]
    step = r.get("estimated_step_seconds")
    est = f"{step:.3f}" if step else "-"
    device, host = r.get("optimizer_device_bytes", 0), r.get("optimizer_host_bytes", 0)
    split = f"{device / GIB:.2f} / {host / GIB:.2f}" if device or host else "-"
    return (
        f"| {r['name']} | `{' '.join(r['flags'])}` | {peak / GIB:.2f} | "
        f"{_error(r.get('predicted_peak_bytes'), peak)} | {_error(without.get(r['name']), peak)} | "
        f"{split} | {r['step_seconds_median']:.3f} / {est} | {r['losses'][-1]:.4f} |"
    )


def _without_gpu(path: str) -> dict[str, int]:
    """The forecasts made without a GPU (bench/gpu_forecast.py) of the runs of a results file."""
    found = os.path.join(os.path.dirname(path), "forecast_without_gpu.json")
    if not os.path.exists(found):
        return {}
    with open(found) as f:
        return {r["name"]: r["predicted_peak_bytes"] for r in json.load(f)["runs"]}


def _trained(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that trained (the H200 file keeps those only, without a train_rc)."""
    return [r for r in data["runs"] if r.get("train_rc", 0) == 0 and r.get("peak_bytes")]


def _note(path: str) -> list[str]:
    """The run's note.md (what the results file cannot say), if any."""
    note = os.path.join(os.path.dirname(path), "note.md")
    if not os.path.exists(note):
        return []
    with open(note) as f:
        return ["", " ".join(f.read().split())]


def _errors(rows: list[tuple[int, int | None]]) -> str:
    """'N, worst W%, median M%' over (measured, forecast) pairs with a forecast."""
    errors = [100 * (got - peak) / peak for peak, got in rows if got]
    if not errors:
        return "none"
    worst = max(errors, key=abs)
    return f"{len(errors)}, worst {worst:+.2f}%, median {statistics.median(errors):+.2f}%"


def _summary(results: list[tuple[dict[str, Any], dict[str, int]]]) -> list[str]:
    """One sentence over every run that trained: how many of them each forecast covers, its worst
    and median error."""
    runs = [(r, without) for data, without in results for r in _trained(data)]
    if not runs:
        return []
    gpu = _errors([(r["peak_bytes"], r.get("predicted_peak_bytes")) for r, _ in runs])
    cpu = _errors([(r["peak_bytes"], w.get(r["name"])) for r, w in runs])
    return [
        "",
        f"**In all:** {len(runs)} runs trained. Forecast profiled on the GPU: {gpu}. Forecast "
        f"made without a GPU: {cpu}.",
    ]


def _header(name: str, data: dict[str, Any]) -> str:
    env = data.get("environment") or {}
    failed = _failed(data) if len(_trained(data)) < len(data["runs"]) else ""
    if not env:  # the H200 file: its note says where it ran
        return f"**{name}**: {len(data['runs'])} runs. {failed}"
    return (
        f"**{name}**: {env.get('gpu', 'no GPU')}, torch {env['torch']}, megatron-core "
        f"{env['megatron_core']}, {data.get('wall_s', '?')} s. {failed}"
    )


def gpu_sections(root: str) -> str:
    """The section, or '' when no GPU run has been recorded."""
    paths = sorted(glob.glob(os.path.join(root, "bench/results/gpu/*/gpu_h*.json")))
    if not paths:
        return ""
    out = [
        "\n\n## On a real GPU (bench/gpu_h100.py, run by bench/gpu_run.sh on a lent GPU)\n",
        "Single-GPU training runs (the local spec: Transformer Engine cannot be installed "
        "there), each `capture-megatron train --nproc 1` with `--memory-report`. Columns: "
        "measured peak GiB (max_memory_allocated over the training iterations); the forecast "
        "profiled on that GPU (`predict --device cuda`) and the forecast made without a GPU "
        "(`predict --device fake-cuda` of the same flags on a CPU machine, bench/gpu_forecast.py: "
        "what a user without the GPU gets), each in GiB with its error; the optimizer state "
        "HybridDeviceOptimizer placed on the GPU and in host memory (optimizer offload runs); the "
        "median measured step / the step-time model's estimate in seconds (the model is "
        "calibrated on Transformer Engine runs; these run the local spec); and the loss at the "
        "last iteration. Neither GPU machine had Transformer Engine or apex, so megatron-core "
        "trained with torch's AdamW: the forecasts without a GPU say so (`--adam-impl torch`).",
    ]
    results = []
    for path in paths:
        with open(path) as f:
            results.append((json.load(f), _without_gpu(path)))
    out += _summary(results)
    for path, (data, without) in zip(paths, results):
        out += ["", _header(os.path.basename(os.path.dirname(path)), data)]
        out += _note(path)
        trained = _trained(data)
        if trained:
            out += [
                "",
                "| run | flags | measured GiB | profiled on the GPU GiB (error) | without a GPU "
                "GiB (error) | optimizer GiB GPU / host | step s measured / est. | last loss |",
                "|---|---|---|---|---|---|---|---|",
                *(_row(r, without) for r in trained),
            ]
    return "\n".join(out) + "\n"
