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


def _constant_rows(data: dict) -> list[str]:
    """The constants: value, fitted or set, what each is (Constants' field docstrings)."""
    from capture_megatron.fields import field_docs
    from capture_megatron.steptime.constants import Constants

    notes = field_docs(Constants)
    out = ["| constant | value | | what it is |", "|---|---|---|---|"]
    for n, v in data["constants"].items():
        if n == "provenance":
            continue
        kind = "fitted" if n in data["fitted"] else "set"
        out.append(f"| {n} | {v:.4g} | {kind} | {notes.get(n, '')} |")
    return out


def _breakdown_table(data: dict) -> list[str]:
    """The MoE rows' estimated steps part by part (bench/step_time.py's breakdowns)."""
    from capture_megatron.steptime.breakdown import LABELS

    rows = [r for r in data["rows"] if r.get("moe")]
    if not rows:
        return []
    out = [
        "Where the estimated MoE steps go (capture_megatron.steptime.breakdown; the slowest "
        "pipeline rank's micro-batches, then the step's own parts):",
        "",
        "| part | " + " | ".join(r["id"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for key, label in LABELS.items():
        values = [r["breakdown"][key] for r in rows]
        if any(values):
            out.append(
                f"| {label} | "
                + " | ".join(
                    f"{v:.2f} s ({v / r['breakdown']['seconds']:.0%})" for v, r in zip(values, rows)
                )
                + " |"
            )
    out.append("| step | " + " | ".join(f"{r['estimated_s']:.2f} s" for r in rows) + " |")
    return out


def calibration_tables(data: dict) -> list[str]:
    """Every development row measured vs estimated, the summary, the pairs, the constants."""
    s = data["summary"]
    out = [
        f"{s['rows']} published H100 BF16 step times (`bench/data/step_times_h100_dev.json`: "
        f"dense; `bench/data/step_times_h100_moe_dev.json`: {s['moe_rows']} DeepSeek-V3 rows), "
        "each estimated with the settings its own recipe config used (`bench/data/"
        "step_time_recipes.json`). Error: (estimated - measured) / measured with the shipped "
        "constants (fitted to all rows); held out: the same row when the constants are fitted "
        "without its model (leave-one-model-out) or its family (leave-one-family-out: the Llama "
        "3.1 sizes together; holding out DeepSeek-V3 leaves all_to_all_efficiency at its prior).",
        "",
        "| row | family | GPUs | configuration | measured s | estimated s | error | held out "
        "(model) | held out (family) | est. MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        out.append(
            f"| {r['id']} | {r['family']} | {r['gpus']} | {r['config']} | {r['measured_s']:.3f} "
            f"| {r['estimated_s']:.3f} | {_pct(r['error'])} | {_pct(r['lomo_error'])} | "
            f"{_pct(r['lofo_error'])} | {100 * r['mfu']:.1f}% |"
        )
    moe_models = {r["model"] for r in data["rows"] if r.get("moe")}
    moe_families = {r["family"] for r in data["rows"] if r.get("moe")}
    by_model = ", ".join(
        f"{m} {100 * v:.1f}%" for m, v in s["lomo_median_by_model"].items() if m not in moe_models
    )
    by_family = ", ".join(
        f"{m} {100 * v:.1f}%"
        for m, v in s["lofo_median_by_family"].items()
        if m not in moe_families
    )
    moe_in = ", ".join(_pct(e) for e in s["moe_in_sample_errors"])
    moe_out = ", ".join(_pct(e) for e in s["moe_lofo_errors"])
    out += [
        "",
        f"Dense, in sample: median |error| **{100 * s['in_sample_median_abs_error']:.1f}%**, "
        f"worst **{100 * s['in_sample_max_abs_error']:.1f}%**. Leave-one-model-out: median "
        f"**{100 * s['lomo_median_abs_error']:.1f}%**, worst {100 * s['lomo_max_abs_error']:.1f}%"
        f" (median per held-out model: {by_model}). Leave-one-family-out: median "
        f"**{100 * s['lofo_median_abs_error']:.1f}%**, worst {100 * s['lofo_max_abs_error']:.1f}%"
        f" (median per held-out family: {by_family}).",
        "",
        f"MoE (DeepSeek-V3 on 512 and 1024 GPUs): in sample **{moe_in}**; its family held out "
        f"(the MoE constant at its prior): {moe_out}.",
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
    out += ["", *_breakdown_table(data)]
    out += ["", "Constants (fitted: " + ", ".join(data["fitted"]) + "; the others set):", ""]
    out += _constant_rows(data)
    out += ["", f"Provenance: {data['constants']['provenance']}."]
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
