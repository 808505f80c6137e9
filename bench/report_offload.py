"""The "fewest GPUs with offload" section of docs/BENCHMARKS.md (from
bench/results/offload_gpus.json, written by bench/offload_gpus.py; see bench/report.py)."""

from __future__ import annotations

from typing import Any

from report_results import read_result

DEEPSEEK = (
    "DeepSeek-V3 itself (tests/data/hf_configs/DeepSeek-V3.json: MLA, 256 routed experts, MTP) was "
    "tried once: the first round of its cold profile on the GPU kernel set had not finished after "
    "18 minutes on this shared 2-core CPU (stopped; the brief's limit was 15), so its row is a "
    "dense model of its parameter count (deepseek-v3-dense), whose optimizer state is the same "
    "12 bytes per parameter but sharded over data-parallel ranks only, not expert ranks."
)
"""Why the DeepSeek-V3-sized row is dense (a fact of the bench's one try, not a result)."""


def _sizes(r: dict[str, Any]) -> str:
    p = r["plan"]
    ep = f" EP{p['ep']}" if p.get("ep", 1) > 1 else ""
    return f"TP{p['tp']} PP{p['pp']} DP{p['dp']}{ep}"


def _cell(r: dict[str, Any]) -> str:
    """GPUs (sizes), or why none fits."""
    if r.get("exit"):
        return f"none ({r.get('why', '')[-120:]})"
    return f"{r['gpus']} ({_sizes(r)})"


def _fraction(f: float) -> str:
    return {0: "0", 0.25: "1/4", 0.5: "1/2", 0.75: "3/4", 1: "all"}.get(f, f"{f:g}")


def _moved(r: dict[str, Any]) -> str:
    """What a row's plan offloads: the optimizer's fraction, the activations' module groups."""
    parts = [f"optimizer {_fraction(r['offload_fraction'])}"] if r["offload_fraction"] else []
    groups = r.get("activation_offload", [])
    parts += [f"activations of {', '.join(groups)}"] if groups else []
    return "; ".join(parts) or "nothing"


def offload_table(data: dict[str, Any]) -> list[str]:
    """One row per model: the fewest GPUs without offload, with fine-grained activation
    offloading searched (the optimizer on the GPUs), and with both searched; by how much offload
    lowers the count, and the estimated slowdown (step time with offload over without, at the
    same global batch: the time to train the same tokens) and GPU-seconds per step."""
    out = [
        "`capture-megatron plan --objective min-gpus` of each model three times: with "
        "`--optimizer-offload-fraction 0 --no-activation-offload` (without offload), with "
        "`--optimizer-offload-fraction 0` (activation offload: fine-grained activation "
        "offloading's module sets searched -- the attention core; every group of a dense layer; "
        "for MoE layers the experts' too -- the optimizer on the GPUs) and with both left to the "
        "planner (with offload: the optimizer fraction searched too, 0, 1/4, 1/2, 3/4, 1: "
        "--optimizer-cpu-offload with the precision-aware optimizer at fp32); "
        "on GPUs of 80 GiB (1 to 8, then whole nodes of 8, up to each row's limit), fixed: "
        f"`{data['fixed']}`; GPU kernel set (fake CUDA), the planner's margins, the h100-sxm "
        "profile (64 GB/s host link per GPU, 2 TiB host memory per node). Slowdown: the estimated "
        "step with offload over the step without it (same global batch, so the time to train the "
        "same tokens); GPU-s: GPUs x step seconds, the GPU time per step; plan s: each command's "
        "wall seconds on this shared CPU (the first run profiles the model, cold). The host "
        "Adam's speed is an assumption from one published measurement with one rank per node "
        "(plan/offload_cost.py); eight ranks sharing a node's CPU are not modelled, so the "
        "slowdown is optimistic. Activation transfers cost only what the layer's compute does not "
        "hide (plan/costparts.py).",
        "",
        "| model | GPUs tried | without offload: GPUs | step s | activation offload: GPUs | "
        "step s | with offload: GPUs | offloaded | step s | host GiB / node | fewer GPUs | "
        "slowdown | GPU-s per step (without -> with) | plan s (without / activations / with) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        a, b = row["without"], row["with"]
        act = row.get("activations", {"exit": 1, "why": "not run", "seconds": 0})
        limit = row.get("limit", 1024)
        seconds = f"{a['seconds']:.0f} / {act['seconds']:.0f} / {b['seconds']:.0f}"
        act_step = "-" if act.get("exit") else f"{act['step_s']:.1f}"
        if a.get("exit") or b.get("exit"):
            out.append(
                f"| {row['model']} | {limit} | {_cell(a)} | - | {_cell(act)} | {act_step} | "
                f"{_cell(b)} | - | - | - | - | - | - | {seconds} |"
            )
            continue
        fewer = a["gpus"] - b["gpus"]
        fewer_s = f"{fewer} ({100 * fewer / a['gpus']:.0f}%)" if fewer else "0"
        slow = b["step_s"] / a["step_s"]
        out.append(
            f"| {row['model']} | {limit} | {_cell(a)} | {a['step_s']:.1f} | {_cell(act)} | "
            f"{act_step} | {_cell(b)} | {_moved(b)} | {b['step_s']:.1f} | "
            f"{b['host_gib_per_node']:.0f} | {fewer_s} | {slow:.2f}x | "
            f"{a['gpus'] * a['step_s']:.0f} -> "
            f"{b['gpus'] * b['step_s']:.0f} | {seconds} |"
        )
    out += ["", "Sources: " + "; ".join(f"{r['model']}: {r['source']}" for r in data["rows"])]
    if any(r["model"] == "deepseek-v3-dense" for r in data["rows"]):
        out += ["", DEEPSEEK]
    return out


def offload_sections(root: str) -> str:
    """The section, or '' when the bench has not run."""
    data = read_result(root, "offload_gpus")
    if data is None:
        return ""
    return "\n\n## Fewest GPUs of 80 GiB with offload (bench/offload_gpus.py)\n\n" + "\n".join(
        offload_table(data)
    )
