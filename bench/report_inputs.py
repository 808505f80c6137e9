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


def published_fit_section(root: str) -> str:
    """Runs NVIDIA published as run on 80 GB H100s, forecast (bench/published_fit.py; '' when it
    has not run)."""
    data = read_result(root, "published_fit")
    if data is None:
        return ""
    out = [
        "\n## Published 80 GB H100 runs: do they fit? (bench/published_fit.py)\n",
        "Each line as tests/data/published_runs/README.md translates it (Megatron-LM's Llama 3 8B "
        "FP8 example as its script passes it, and as its README's table ran it), forecast on "
        "the GPU kernel set; need: the worst rank's forecast plus the planner's margins "
        "(docs/MEMORY_MODEL.md, 'Margins'); in flight: the worst rank's micro-batches alive per "
        "model chunk at its peak.\n",
        "What the published runs set that a plain translation misses, from the sources: "
        "Grok-1's recipe reduces gradients in bf16 (`optim.grad_sync_dtype: bf16`), caps every "
        "expert at its even share (`moe_expert_capacity_factor: 1.0`, padded), and runs FP8 with "
        "FP8 parameters by default (DTYPE=fp8); on rank 0 megatron-core's interleaved schedule "
        "holds (PP - 1) x 2 + (VP - 1) x PP + 1 = 71 one-layer chunks at the end of its warm-up "
        "(`get_pp_rank_microbatches`, `microbatch_group_size_per_vp_stage` = PP; NeMo 24.12's "
        "megatron-core counts the same), which is no overcount. Megatron-LM's Llama 3 8B FP8 "
        "script passes `--context-parallel-size 1`; its README's performance table ran CP 2.\n",
        "| run | worst rank peak GiB | need GiB | fits 80 GB | phase | in flight | what it shows |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["cases"]:
        if "refused" in r:
            out.append(f"| {r['name']} | refused: {_cell(r['refused'])} | | | | | {r['note']} |")
            continue
        flight = sum(r["inflight"])
        out.append(
            f"| {r['name']} | {r['peak_gib']:.1f} (rank {r['worst_rank']}) | "
            f"{r['needed_gib']:.1f} | {'yes' if r['fits'] else 'no'} | {r['phase']} | "
            f"{flight} | {r['note']} |"
        )
    return "\n".join(out) + "\n" + _published_differences(data["cases"])


CARD_GIB = 81559 * 2**20 / 2**30
"""An 80 GB H100's memory as the driver reports it (81,559 MiB), in GiB."""


def _published_differences(cases: list[dict]) -> str:
    """For each published run forecast not to fit: the difference that makes it not fit (issue
    51, must-show 4)."""
    lines = []
    for r in cases:
        if "refused" in r or r["fits"]:
            continue
        margin = r["needed_gib"] - r["peak_gib"]
        if r["peak_gib"] <= CARD_GIB:
            lines.append(
                f"- {r['name']}: its forecast peak, {r['peak_gib']:.1f} GiB, is within the card's "
                f"{CARD_GIB:.1f} GiB; what does not fit is the {margin:.1f} GiB of margins the "
                "planner keeps above a peak (the CUDA context and NCCL, and the allocator's "
                "reserve, measured on a dense Megatron run). The published run ran, so the "
                f"forecast and the margins together are at least {r['needed_gib'] - CARD_GIB:.1f} "
                "GiB high for it."
            )
        else:
            lines.append(
                f"- {r['name']}: its forecast peak, {r['peak_gib']:.1f} GiB, is above the card's "
                f"{CARD_GIB:.1f} GiB: the difference from the published run is named in its row "
                f"({r['note']}), and the row beside it shows the run as published."
            )
    return ("\nWhy the ones that do not fit do not:\n\n" + "\n".join(lines) + "\n") if lines else ""
