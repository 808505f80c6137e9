"""The mixture-of-experts and context-parallel sections of docs/BENCHMARKS.md (from
bench/results/moe_cp_cpu.json and moe_plans.json; see bench/report.py)."""

from __future__ import annotations

from report_results import read_result

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
    out += ["", *dropless_table(data)]
    return out


def dropless_table(data: dict) -> list[str]:
    """The dropless seeds: forecast, planning factor and bound against the measured worst rank."""
    out = [
        f"Dropless routing (`{data['dropless']}`): the default forecast (routing statistics "
        "measured in aux-loss-balanced training, bench/moe_routing.py), the planning factor "
        "(forecast plus margin) and the worst-case bound against the measured worst rank, per "
        "seed.",
        "",
    ]
    out += [
        "| seed | factors (forecast / planning / bound) | forecast MiB | planning MiB | bound MiB "
        "| measured MiB | forecast error |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in data["seeds"]:
        factors = " / ".join(f"{f:g}" for f in s["factors"])
        err = s["forecast_mib"] / s["measured_mib"] - 1
        out.append(
            f"| {s['seed']} | {factors} | {s['forecast_mib']:.3f} | {s['planning_mib']:.3f} | "
            f"{s['bound_mib']:.3f} | {s['measured_mib']:.3f} | {100 * err:+.2f}% |"
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


def routing_tables(data: dict) -> list[str]:
    """The routing statistics of the default dropless forecast and the check of its formula."""
    out = [
        f"Source: {data['source']}. Per run: s, the spread of an expert's expected load over its "
        "balanced share (standard deviation over experts, root mean square over layers), and "
        "rho, the over-dispersion of a sequence's token counts (1: independent tokens), each the "
        "largest over the run's last two of five phases (the statistics shipped); s of every "
        "phase is shown (training progress), and the loss of the first and the last phase.",
        "",
        "| run | experts | top-k | balancing | coefficient | s | rho | s by phase | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        phases = ", ".join(f"{p['spread']:.3f}" for p in r["phases"])
        loss = f"{r['phases'][0]['loss']:.2f} -> {r['phases'][-1]['loss']:.2f}"
        out.append(
            f"| {r['name']} | {r['num_experts']} | {r['topk']} | {r['balancing']} | "
            f"{r['coeff']:g} | {r['spread']:.3f} | {r['overdispersion']:.2f} | {phases} | {loss} |"
        )
    first = max(r["phases"][0]["spread"] for r in data["runs"])
    out += [
        "",
        "What these runs can and cannot say: they measure megatron-core's own routers and "
        "dispatchers, but in a 4-layer model of hidden size 128 on byte tokens for 250 steps. "
        f"Their first steps route far less evenly (s up to {first:.2f} in the first phase, "
        "already at initialisation): that phase is left out of the shipped statistics, which "
        "a pretrained model (Megatron-LM's Mixtral example loads a converted checkpoint) or a "
        "larger model need not show, but a small model trained from scratch may hold for its "
        "first hundred steps. Whether a model of hidden size 4096 keeps the late spread after "
        "100k steps is not measured here; the over-dispersion comes from 256-token sequences "
        "(longer documents may route more alike); and without load balancing (coefficient 0) "
        "nothing evens the routing out: its s is what that CPU run held, not a bound.",
        "",
        "The formula (capture_megatron/forecast/routing.py) against the imbalance measured "
        "directly: the step's sequences grouped into EP groups of the given tokens, the largest "
        "EP rank's tokens over the group's mean per rank, over every step, layer and group.",
        "",
        "| run | EP | tokens per EP group | measured mean | forecast | measured p95 | planning "
        "| samples |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in data["checks"]:
        out.append(
            f"| {c['run']} | {c['ep']} | {c['tokens']} | {c['measured_mean']:.3f} | "
            f"{c['forecast']:.3f} | {c['measured_p95']:.3f} | {c['planning']:.3f} | "
            f"{c['samples']} |"
        )
    return out


def default_table(data: dict) -> list[str]:
    """Published MoE setups at the default forecast, with the planning factor and the bound."""
    out = [
        "| setup | GPUs | sizes | forecast GiB (factor) | planning GiB (factor) | need GiB | fits "
        "80 GiB | worst-case bound GiB (factor) | bound fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            out.append(f"| {r['model']} | {r['gpus']} | {_cell(r['error'])} | | | | | | |")
            continue
        f, p, b = r["factors"]
        out.append(
            f"| {r['model']} | {r['gpus']} | {r['sizes']}, recompute {r['recompute']} | "
            f"{r['forecast_gib']:.1f} ({f:g}) | {r['planning_gib']:.1f} ({p:g}) | "
            f"{r['needed_gib']:.1f} | {'yes' if r['fits'] else 'no'} | {r['bound_gib']:.1f} "
            f"({b:g}) | {'yes' if r['bound_fits'] else 'no'} |"
        )
    out.append("")
    for r in data["rows"]:
        if r.get("left_out"):
            out.append(
                f"- {r['model']}: left out (refused by this version): {', '.join(r['left_out'])}"
            )
    sources = sorted({r["source"] for r in data["rows"] if "source" in r})
    out += [f"- forecast source: {s}" for s in sources]
    return out


def _cell(text: str) -> str:
    """Text inside a markdown table cell (pipes escaped)."""
    return text.replace("|", "\\|")


def moe_sections(root: str) -> str:
    """The sections whose results exist ('' when none)."""
    text = ""
    data = read_result(root, "moe_cp_cpu")
    if data is not None:
        text += (
            "\n\n## Mixture-of-experts and context parallelism on the CPU (bench/moe_cp_cpu.py)"
            "\n\n" + "\n".join(moe_cp_tables(data)) + "\n"
        )
    data = read_result(root, "moe_routing")
    if data is not None:
        text += (
            "\n## The default dropless MoE forecast: routing statistics measured on the CPU "
            "(bench/moe_routing.py)\n\n" + "\n".join(routing_tables(data)) + "\n"
        )
    data = read_result(root, "moe_default")
    if data is not None:
        text += (
            "\n## Published MoE setups at the default forecast (bench/moe_default.py; GPU kernel "
            "set, 80 GiB GPUs)\n\n" + "\n".join(default_table(data)) + "\n"
        )
    data = read_result(root, "moe_plans")
    if data is not None:
        text += (
            "\n## Mixture-of-experts plans at scale, balanced vs uniform (bench/moe_plans.py; "
            f"memory model: {data.get('memory_model', 'CPU kernels under FakeTensorMode')}, "
            "objective min-peak, selective recompute)\n\n" + "\n".join(moe_plan_table(data)) + "\n"
        )
    return text


def moe_vs_nvidia_section(root: str) -> str:
    """The planner's MoE plans beside NVIDIA's recipes (bench/moe_vs_nvidia.py; '' before it)."""
    data = read_result(root, "moe_vs_nvidia")
    if data is None:
        return ""
    out = [
        "\n## MoE plans beside NVIDIA's configurations (bench/moe_vs_nvidia.py; issue 51)\n",
        "Each model planned (default objective: the fastest plan that fits 80 GB H100s) from "
        "Megatron-Bridge v0.3.1's H100 BF16 recipe line without its parallel sizes, micro-batch, "
        "recompute and split, at the recipe's GPUs and global batch, with `--compare-with` the "
        "recipe's own line: both estimated by the same step-time model (docs/STEP_TIME.md). Where "
        "the plan claims more than 15% over NVIDIA's configuration, where each step's time goes "
        "is shown below the table. These are estimates, not measurements: NVIDIA's measured "
        "DeepSeek-V3 steps are the step-time model's development rows (docs/STEP_TIME.md). A "
        "large claimed gain is first a question about the clock: for Qwen3-235B-A22B the model "
        "estimates NVIDIA's recipe at 23.7 s per step of 2048 sequences, above the 17.6 s NVIDIA "
        "measured for the best of five configurations on the same 256 H100s (issue 51), and "
        "charges its EP 32 over eight nodes 10.3 s of exposed dispatch and combine: the claim is "
        "not trusted until that exposure is measured.\n",
        "| model | GPUs | NVIDIA's configuration | its est. tokens/s/GPU | the plan | its est. "
        "tokens/s/GPU | plan vs NVIDIA | plan peak GiB | planned in |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    blocks = []
    for r in data["rows"]:
        if "refused" in r:
            out.append(
                f"| {r['model']} | {r['gpus']} | `{r['nvidia']}` | refused: {r['refused']} "
                f"| | | | | {r['seconds']:.0f} s |"
            )
            continue
        n, p, c = r["nvidia_sizes"], r["plan"], r["compared_with"]
        theirs = (
            f"TP{n.get('tp', 1)} PP{n.get('pp', 1)} VPP{n.get('vpp', 1)} EP{n.get('ep', 1)} "
            f"CP{n.get('cp', 1)} mbs {n.get('mbs', 1)}, {n.get('recompute', 'no')} recompute"
            + (f" ({n['modules']})" if n.get("modules") else "")
            + f", {n.get('dispatcher', 'allgather')}"
        )
        rc = {"": "no", "none": "no"}.get(
            p["recompute"]["granularity"], p["recompute"]["granularity"]
        )
        ours = (
            f"TP{p['tp']} PP{p['pp']} VPP{p['vpp']} EP{p['ep']} CP{p['cp']} mbs "
            f"{p['micro_batch_size']}, {rc} recompute"
        )
        gain = c["plan_tokens_per_s_per_gpu"] / c["given_tokens_per_s_per_gpu"] - 1
        out.append(
            f"| {r['model']} | {r['gpus']} | {theirs} | {c['given_tokens_per_s_per_gpu']:,.0f} | "
            f"{ours} | {c['plan_tokens_per_s_per_gpu']:,.0f} | {gain:+.1%} | "
            f"{r['peak_gib']:.1f} | {r['seconds']:.0f} s |"
        )
        if r.get("side_by_side"):
            blocks += [f"\n{r['model']} on {r['gpus']} GPUs, the plan beside NVIDIA's:\n", "```"]
            blocks += [line[2:] for line in r["side_by_side"]] + ["```"]
    return "\n".join(out + blocks) + "\n"
