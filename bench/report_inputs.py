"""The "inputs nobody here wrote" section of docs/BENCHMARKS.md, from bench/results/inputs.json
(bench/inputs.py; see bench/report.py)."""

from __future__ import annotations

from report_results import read_result

TITLES = {
    "megatron_lm_examples": "Megatron-LM's example launch lines (core_v0.16.1)",
    "moe_modelzoo": "Megatron MoE Model Zoo configs",
    "megatron_bridge": "Megatron-Bridge H100 recipes (v0.3.1)",
    "hf_configs": "published HF config.json (`plan --hf-config`, 64 x 80 GiB)",
    "functional_tests": "Megatron-LM's functional tests (with a world size)",
}
STAGES = {
    "dry": "the parse and refusal stage (everything before the first profile)",
    "forecast": "the whole forecast (profiled on the spot, GPU kernel set on fake CUDA tensors)",
}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def inputs_tables(data: dict) -> list[str]:
    """Accepted / refused / tracebacks per input set, then each set's refusal causes."""
    out = [
        "Stages: `dry` is " + STAGES["dry"] + "; `forecast` is " + STAGES["forecast"] + ". "
        "Accepted: the stage passed (a forecast: exit 0); refused: one paragraph, exit 2; a "
        "traceback is a bug. `--vocab-size` is added only where a line's tokenizer file is not "
        "here (column 'vocab added'). 'with fix': accepted as written, or once the change a "
        "refusal names for a line Megatron-LM itself stops at is made (--tp-comm-overlap at TP 1 "
        "left out).",
        "",
        "| input set | command | stage | inputs | accepted | with fix | refused | tracebacks "
        "| vocab added |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in data["sets"].items():
        stage = res["stage"]
        for command, s in res["summary"].items():
            counts = s["outcomes"]
            accepted = counts.get("accepted" if stage == "forecast" else "passed-dry", 0)
            fixed = s.get("accepted_with_fix", accepted)
            out.append(
                f"| {TITLES.get(name, name)} | {command} | {stage} | {s['inputs']} | {accepted} | "
                f"{fixed} | {counts.get('refused', 0)} | {counts.get('traceback', 0)} | "
                f"{s['vocab_added']} |"
            )
    out += ["", "Refusal causes, `predict` (the flags named; an input can have several):", ""]
    out += ["| input set | cause | inputs |", "|---|---|---|"]
    for name, res in data["sets"].items():
        first = res["summary"].get("predict") or res["summary"]["plan"]
        for cause, n in first["refusal_causes"].items():
            out.append(f"| {TITLES.get(name, name)} | {_cell(cause)} | {n} |")
    return out


def inputs_section(root: str) -> str:
    """The section's markdown ('' when the bench has not run)."""
    data = read_result(root, "inputs")
    if data is None:
        return ""
    return (
        "\n## Inputs nobody here wrote: accepted as written (bench/inputs.py)\n\n"
        + "\n".join(inputs_tables(data))
        + "\n"
    )


def hf_planned_section(root: str) -> str:
    """Today's published models planned (bench/hf_planned.py; '' when it has not run)."""
    data = read_result(root, "hf_planned")
    if data is None:
        return ""
    out = [
        "\n## Today's published models planned (`plan --hf-config`, bench/hf_planned.py)\n",
        f"Each published config.json (tests/data/hf_configs) planned by the default objective on "
        f"GPUs of {data['gpu_memory_gib']} GiB; parameters as megatron-core builds the model "
        "against the model card's total; need: the worst rank's forecast plus the planner's "
        "margins; wall time in a fresh process (cold: profiled on the spot on this machine, "
        "shared with other work).\n",
        "| model | parameters | published | GPUs | plan | recompute | need GiB | fits "
        "| step s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        count = f"{r['parameters'] / 1e9:.2f}B" if r["parameters"] else "-"
        head = f"| {r['model']} | {count} | {r['published'] / 1e9:g}B | {r['gpus']} |"
        if "plan" not in r:
            out.append(f"{head} exit {r['exit']}: {_cell(r.get('why', ''))} | | | | | |")
            continue
        p = r["plan"]
        sizes = f"TP{p['tp']} PP{p['pp']} DP{p['dp']} EP{p['ep']} VPP{p['vpp']}"
        sizes += f" mbs{p['micro_batch_size']}"
        sizes += (
            f" optimizer offload {r['optimizer_offload']:g}" if r.get("optimizer_offload") else ""
        )
        act = r.get("activation_offload")
        sizes += f" activation offload of {', '.join(act)}" if act else ""
        rc = r["recompute"]["granularity"] if isinstance(r["recompute"], dict) else r["recompute"]
        if rc == "full" and isinstance(r["recompute"], dict):
            rc += f" of {r['recompute']['num_layers']} layers per stage"
        step = f"{r['step_s']:.2f}" if r.get("step_s") else "-"
        wall = f"{r['seconds']:.0f} ({'cold' if r['cold'] else 'warm'})"
        out.append(
            f"{head} {sizes} | {rc} | {r['needed_gib']:.1f} | {r['fits']} | {step} | {wall} |"
        )
    notes = [f"- {r['model']}: {r['note']}" for r in data["rows"] if r.get("note")]
    return "\n".join(out + ([""] + notes if notes else [])) + "\n"
