"""The mixture-of-experts and context-parallel sections of docs/BENCHMARKS.md (from
bench/results/moe_cp_cpu.json and moe_plans.json; see bench/report.py)."""

from __future__ import annotations

import json
import os

NAMES = ("uniform", "megatron-first-last", "deepspeed-parameters")


def moe_cp_tables(data: dict) -> list[str]:
    """Per-rank forecast vs measured of the MoE / CP cases, and the dropless bound over seeds."""
    out = [
        f"Model: `{data['model']}`, 2 iterations, fp32, CPU kernel set.",
        "",
        "| case | processes | predicted MiB per pipeline rank | measured MiB | max abs error |",
        "|---|---|---|---|---|",
    ]
    for c in data["cases"]:
        pred = ", ".join(f"{x:.3f}" for x in c["predicted_mib"])
        meas = ", ".join(f"{x:.3f}" for x in c["measured_mib"])
        out.append(
            f"| {c['case']} | {c['processes']} | {pred} | {meas} | "
            f"{100 * c['max_abs_error']:.2f}% |"
        )
    out += [
        "",
        f"Dropless routing (`{data['dropless']}`): the forecast's worst-case bound (no "
        "`--moe-imbalance-factor`) against the measured worst rank, per seed.",
        "",
        "| seed | bound MiB | measured MiB | measured / bound |",
        "|---|---|---|---|",
    ]
    for s in data["seeds"]:
        out.append(
            f"| {s['seed']} | {s['bound_mib']:.3f} | {s['measured_mib']:.3f} | "
            f"{s['measured_mib'] / s['bound_mib']:.3f} |"
        )
    return out


def moe_plan_table(data: dict) -> list[str]:
    """Per model: the balanced plan's sizes, layout and worst rank against the other splits."""
    out = [
        "| model | GPUs | sizes | layout (balanced) | balanced GiB | "
        + " | ".join(f"{n} GiB" for n in NAMES)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(NAMES),
    ]
    for r in data["rows"]:
        p, ours = r["plan"], max(r["peaks_gib"])
        cells = []
        for n in NAMES:
            b = r["baselines"].get(n, {"unavailable": "-"})
            if "unavailable" in b:
                cells.append("n/a")
                continue
            theirs = max(b["peaks_gib"])
            cells.append(f"{theirs:.1f} ({100 * (1 - ours / theirs):+.1f}% by balancing)")
        sizes = (
            f"TP {p['tp']} PP {p['pp']} DP {p['dp']} EP {p['ep']} VPP {p['vpp']}, "
            f"recompute {p['recompute']['granularity']}"
        )
        out.append(
            f"| {r['model']} | {r['gpus']} | {sizes} | `{p['layout']}` | {ours:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    out.append("")
    for r in data["rows"]:
        out.append(f"- {r['model']} (`{r['flags']}`): " + "; ".join(r["notes"]))
    return out


def _result(root: str, name: str) -> dict | None:
    """bench/results/`name`, or None when that bench has not been run."""
    path = os.path.join(root, "bench/results", name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def moe_sections(root: str) -> str:
    """The sections whose results exist ('' when none)."""
    text = ""
    data = _result(root, "moe_cp_cpu.json")
    if data is not None:
        text += (
            "\n\n## Mixture-of-experts and context parallelism on the CPU (bench/moe_cp_cpu.py)"
            "\n\n" + "\n".join(moe_cp_tables(data)) + "\n"
        )
    data = _result(root, "moe_plans.json")
    if data is not None:
        text += (
            "\n## Mixture-of-experts plans at scale, balanced vs uniform (bench/moe_plans.py; "
            f"memory model: {data.get('memory_model', 'CPU kernels under FakeTensorMode')}, "
            "objective min-peak, selective recompute)\n\n" + "\n".join(moe_plan_table(data)) + "\n"
        )
    return text
