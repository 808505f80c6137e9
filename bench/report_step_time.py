"""The step-time section of docs/BENCHMARKS.md (from bench/results/step_time.json, written by
bench/step_time.py, and bench/results/llama_recipes.json, by bench/llama_recipes.py; see
bench/report.py)."""

from __future__ import annotations

import json
import os

from report_results import read_result

GIB = 2**30


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def calibration_tables(data: dict) -> list[str]:
    """Every development row measured vs estimated, the summary, the pairs, the constants."""
    s = data["summary"]
    out = [
        f"{s['rows']} published H100 BF16 step times (`bench/data/step_times_h100_dev.json`), each "
        "estimated with the settings its own recipe config used (`bench/data/step_time_recipes."
        "json`). Error: (estimated - measured) / measured with the shipped constants (fitted to "
        "all rows); held out: the same row when the constants are fitted without its model family "
        "(leave-one-model-out).",
        "",
        "| row | model | GPUs | configuration | measured s | estimated s | error | held out | "
        "est. MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        out.append(
            f"| {r['id']} | {r['model']} | {r['gpus']} | {r['config']} | {r['measured_s']:.3f} | "
            f"{r['estimated_s']:.3f} | {_pct(r['error'])} | {_pct(r['lomo_error'])} | "
            f"{100 * r['mfu']:.1f}% |"
        )
    by_model = ", ".join(f"{m} {100 * v:.1f}%" for m, v in s["lomo_median_by_model"].items())
    out += [
        "",
        f"In sample: median |error| **{100 * s['in_sample_median_abs_error']:.1f}%**, worst "
        f"**{100 * s['in_sample_max_abs_error']:.1f}%**. Leave-one-model-out: median "
        f"**{100 * s['lomo_median_abs_error']:.1f}%**, worst {100 * s['lomo_max_abs_error']:.1f}% "
        f"(median per held-out family: {by_model}).",
        "",
        f"Ordering: **{s['pairs_agreeing']} of {s['pairs']}** pairs of rows with the same model "
        "and GPU count but a different configuration are ordered as measured:",
        "",
        "| rows | measured s | estimated s | agrees |",
        "|---|---|---|---|",
    ]
    for p in data["pairs"]:
        out.append(
            f"| {p['rows'][0]} vs {p['rows'][1]} | {p['measured'][0]:.3f} vs "
            f"{p['measured'][1]:.3f} | {p['estimated'][0]:.3f} vs {p['estimated'][1]:.3f} | "
            f"{'yes' if p['agrees'] else 'no'} |"
        )
    k = data["constants"]
    out += ["", "Constants (fitted: " + ", ".join(data["fitted"]) + "):", ""]
    out += ["| constant | value |", "|---|---|"]
    out += [f"| {n} | {v:.4g} |" for n, v in k.items() if n != "provenance"]
    out += ["", f"Provenance: {k['provenance']}."]
    return out


def recipe_tables(data: dict) -> list[str]:
    """NVIDIA's Llama 3.1 recipes (CP 2): predicted peak, need, fits 80 GB, estimated step."""
    out = [
        "| recipe | GPUs | configuration | peak GiB (worst rank) | need GiB | fits 80 GiB | "
        "estimated s | measured s | tokens/s/GPU | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["recipes"]:
        out.append(
            f"| {r['id']} | {r['gpus']} | {r['config']} | {r['peak_bytes'] / GIB:.1f} | "
            f"{r['needed_bytes'] / GIB:.1f} | {'yes' if r['fits'] else 'no'} | "
            f"{r['estimated_s']:.2f} | {r['measured_s']:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{100 * r['mfu']:.1f}% |"
        )
    return out


def step_time_sections(root: str) -> str:
    """The markdown of the step-time sections ('' when the bench has not run)."""
    data = read_result(root, "step_time")
    if data is None:
        return ""
    text = (
        "\n## Step time: the cost model against NVIDIA's measured H100 runs "
        "(bench/step_time.py)\n\n" + "\n".join(calibration_tables(data)) + "\n"
    )
    recipes = os.path.join(root, "bench/results/llama_recipes.json")
    if os.path.exists(recipes):
        with open(recipes) as f:
            rec = json.load(f)
        text += (
            "\n## NVIDIA's Llama 3.1 recipes (CP 2) predicted (bench/llama_recipes.py)\n\n"
            + rec["about"]
            + "\n\n"
            + "\n".join(recipe_tables(rec))
            + "\n"
        )
    return text
