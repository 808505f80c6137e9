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
    err = f"{100 * (got - peak) / peak:+.1f}%" if got else "no forecast"
    step = r.get("estimated_step_seconds")
    est = f"{step:.3f}" if step else "-"
    return (
        f"| {r['name']} | `{' '.join(r['flags'])}` | {peak / GIB:.2f} | "
        f"{got / GIB if got else 0:.2f} | {err} | {r['step_seconds_median']:.3f} / {est} |"
    )


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
        "peak GiB (max_memory_allocated over the training iterations), forecast GiB, error, and "
        "the median measured step / the estimate in seconds.",
    ]
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        env = data["environment"]
        name = os.path.basename(os.path.dirname(path))
        trained = [r for r in data["runs"] if r.get("train_rc") == 0]
        out += [
            "",
            f"**{name}**: {env.get('gpu', 'no GPU')}, torch {env['torch']}, megatron-core "
            f"{env['megatron_core']}, {data.get('wall_s', '?')} s. "
            + (_failed(data) if len(trained) < len(data["runs"]) else ""),
        ]
        if trained:
            out += [
                "",
                "| run | flags | measured GiB | forecast GiB | error | step s measured / est. |",
                "|---|---|---|---|---|---|",
                *(_row(r) for r in trained),
            ]
    return "\n".join(out) + "\n"
