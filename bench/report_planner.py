"""The "planner vs NVIDIA's recipes" section of docs/BENCHMARKS.md (from
bench/results/planner_recipes.json, written by bench/planner_recipes.py; see bench/report.py)."""

from __future__ import annotations

from report_results import read_result

GIB = 2**30


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def recipe_table(data: dict) -> list[str]:
    """Each recipe: the default plan beside NVIDIA's configuration, by the same models."""
    out = [
        "For each recipe at the fewest GPUs NVIDIA published it for, with the recipe's global "
        "batch and sequence: the default plan (`plan`'s throughput objective; everything searched "
        "but the recipe's gradient precision) and NVIDIA's configuration (its sizes, layout and "
        "batch), both estimated by the step-time model (docs/STEP_TIME.md) and predicted by the "
        "GPU kernel set's memory model with the same run settings: the data-parallel overlaps "
        "on (the planner turns them on; the recipes run them), TP communication overlap off for "
        "both (three recipes run it; the planner cannot choose it until the memory of its "
        "userbuffers is modelled). Peak: the worst pipeline rank's forecast; need: with the "
        f"planner's margins, against {_gib(_cap(data))} "
        "GiB. In space: NVIDIA's sizes are a candidate of the space the planner searched. "
        "Bound: no plan of the chosen sizes is estimated faster (the time-aware split's proof).",
        "",
        "| recipe | GPUs | batch x seq | default plan | step s | peak / need GiB | bound s | "
        "NVIDIA's configuration | step s | peak / need GiB | fits | in space | plan vs NVIDIA | "
        "search (plans, CPU s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["recipes"]:
        gain = r["nvidia_step_s"] / r["plan_step_s"] - 1
        out.append(
            f"| {r['id']} | {r['gpus']} | {r['global_batch']} x {r['seq_length']} | {r['plan']} | "
            f"{r['plan_step_s']:.2f} | {_gib(r['plan_peak_bytes'])} / "
            f"{_gib(r['plan_needed_bytes'])} | {r['plan_bound_s']:.2f} | {r['nvidia']} | "
            f"{r['nvidia_step_s']:.2f} | {_gib(r['nvidia_peak_bytes'])} / "
            f"{_gib(r['nvidia_needed_bytes'])} | {'yes' if r['nvidia_fits'] else 'no'} | "
            f"{'yes' if r['nvidia_in_space'] else 'no'} | {100 * gain:+.1f}% faster | "
            f"{r['plans_considered']}, {r['search_cpu_s']:.0f} |"
        )
    out += ["", "Layouts (`--pipeline-model-parallel-layout`):", ""]
    for r in data["recipes"]:
        out.append(f"- {r['id']}: plan `{r['plan_layout']}`; NVIDIA `{r['nvidia_layout']}`")
    return out


def _cap(data: dict) -> float:
    """The GPU memory the plans were made for."""
    return data.get("fixed_sizes", {}).get("gpu_memory_bytes", 0)


def fixed_table(data: dict) -> list[str]:
    """Llama 3 70B at fixed sizes: the throughput objective's layout against min-peak's."""
    f = data.get("fixed_sizes") or {}
    if not f:
        return []
    out = [
        f"Llama 3 70B on {f['gpus']} GPUs, global batch {f['global_batch']}, sizes fixed at TP 4, "
        "PP 4, VPP 2, micro-batch 1, no recompute (sequence parallelism and the distributed "
        "optimizer searched): the layout each objective chooses. min-peak keeps CAPTURE's "
        "min-max memory split; throughput minimises the estimated step under the same cap "
        "(tests/unit/test_time_partition.py checks the method on a synthetic model against "
        "every split).",
        "",
        "| objective | layers per rank | step s | worst-rank peak / need GiB | rank peaks GiB "
        "| fits |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("throughput", "min-peak"):
        e = f[name]
        peaks = ", ".join(_gib(x) for x in e["rank_peaks"])
        out.append(
            f"| {name} | {e['layers_per_rank']} | {e['step_s']:.2f} | {_gib(e['peak_bytes'])} / "
            f"{_gib(e['needed_bytes'])} | {peaks} | {'yes' if e['fits'] else 'no'} |"
        )
    t, m = f["throughput"], f["min-peak"]
    out += [
        "",
        f"The memory-balanced split is {100 * (m['step_s'] / t['step_s'] - 1):.1f}% slower for "
        f"{_gib(t['peak_bytes'] - m['peak_bytes'])} GiB lower peak. Layouts: throughput "
        f"`{t['layout']}`; min-peak `{m['layout']}`.",
    ]
    return out


def planner_sections(root: str) -> str:
    """The section's markdown ('' when the bench has not run)."""
    data = read_result(root, "planner_recipes")
    if data is None:
        return ""
    text = "\n## Planner vs NVIDIA's recipes (bench/planner_recipes.py)\n\n"
    text += "\n".join(recipe_table(data)) + "\n"
    if data.get("complete") is False:
        text += (
            "\nA partial run: the recipes above only (the run was cut short; "
            "bench/planner_recipes.py writes each recipe as it finishes).\n"
        )
    fixed = fixed_table(data)
    if fixed:
        text += "\n### The layout at fixed sizes\n\n" + "\n".join(fixed) + "\n"
    load = data.get("load_average_5min")
    if load:
        text += (
            f"\nSearch CPU seconds in one process, the cache as the earlier runs left it; "
            f"5-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end.\n"
        )
    return text
