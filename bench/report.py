"""Render docs/BENCHMARKS.md from bench/results/*.json (run the benches first; nothing is typed in).

python bench/report.py
"""

from __future__ import annotations

import json
import os
import platform

from report_gpu import gpu_sections
from report_inputs import hf_planned_section, inputs_section, published_fit_section
from report_launch import rank_start_section
from report_moe import moe_sections, moe_vs_nvidia_section
from report_offload import offload_sections
from report_planner import planner_sections
from report_step_time import step_time_sections
from report_versions import versions_section

from capture_megatron.config import Kernels
from capture_megatron.config.presets import preset
from capture_megatron.fit import shape_sizes
from capture_megatron.forecast import find_variant
from capture_megatron.profile.source import profiled_model
from capture_megatron.records import ProbeShape, Variant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("capture", "uniform", "megatron-first-last", "deepspeed-parameters")


def _gib(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _less(ours, theirs) -> str:
    return "" if theirs is None or not theirs else f" ({100 * (1 - ours / theirs):.0f}%)"


def partitioner_tables(data: dict) -> list[str]:
    out = [
        "| model | GPUs | CAPTURE sizes | CAPTURE GiB | uniform GiB | Megatron first/last GiB | "
        "DeepSpeed 'parameters' GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    best = [
        "| model | GPUs | CAPTURE | uniform | Megatron first/last | DeepSpeed 'parameters' |",
        "|---|---|---|---|---|---|",
    ]
    for res in data["results"]:
        for row in res["rows"]:
            if "sizes" not in row:
                continue
            at, own = row["at_capture_sizes_gib"], row["best_sizes_gib"]
            cap = at["capture"]
            out.append(
                f"| {res['preset']} | {row['gpus']} | {row['sizes']} | {_gib(cap)} | "
                + " | ".join(f"{_gib(at[n])}{_less(cap, at[n])}" for n in NAMES[1:])
                + " |"
            )
            best.append(
                f"| {res['preset']} | {row['gpus']} | "
                + " | ".join(
                    f"{_gib(own.get(n))}"
                    f"{_less(own['capture'], own.get(n)) if n != 'capture' else ''}"
                    for n in NAMES
                )
                + " |"
            )
    return out, best


def min_gpu_table(data: dict) -> list[str]:
    out = [
        "| model | CAPTURE | uniform | Megatron first/last | DeepSpeed 'parameters' |",
        "|---|---|---|---|---|",
    ]
    for res in data["results"]:
        out.append(
            f"| {res['preset']} | " + " | ".join(str(res["min_gpus"][n]) for n in NAMES) + " |"
        )
    return out


def profile_cost_table(data: dict) -> list[str]:
    out = [
        "| model | layers | probe runs (fake, this CPU) | seconds (profile + fit) | "
        "mCAP-style runs (~1 per layer) |",
        "|---|---|---|---|---|",
    ]
    for res in data["results"]:
        out.append(
            f"| {res['preset']} | {res['layers']} | {res['probes']} | "
            f"{res['profile_and_fit_seconds']:.1f} | "
            f"{res['layers']} per configuration, on the target GPUs |"
        )
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def quality_table(data: dict) -> list[str]:
    """Leave-one-out errors across the 24 CPU design shapes and errors on held-out shapes
    (bench/profile_quality.py)."""
    out = [
        "## Model quality across shapes (CPU, 24 design shapes per variant)",
        "",
        "Leave-one-out maximum relative error over the design shapes, of the regression and of the "
        "replayed allocation timeline (docs/MEMORY_MODEL.md; the timeline is what `fit` uses when "
        "the records carry timelines). Chunk kinds with one layer; saved = saved activations, "
        "fwd/bwd/step = peaks:",
        "",
        "| variant | probe runs | profile s | fit s | quantity | regression LOO | timeline LOO |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in data["variants"]:
        for q in v["quantities"]:
            if q["quantity"] == "layer saved S" or q["quantity"].endswith("1"):
                out.append(
                    f"| {v['variant']} | {v['probes']} | {v['seconds']:.0f} | "
                    f"{v['fit_seconds']:.1f} | "
                    f"{q['quantity']} | {_pct(q['regression'])} | {_pct(q['timeline'])} |"
                )
    out += [
        "",
        f"Held-out shapes ({len(data['held_out'])}, none in the probe set; every chunk kind's "
        "probes, each prediction against its measurement; largest relative error per group):",
        "",
        "| variant | b, s, h, heads, groups, kv, ffn, vocab, TP | checks | saved activations | "
        "transient peaks | params/grads/optimizer | worst quantity |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["held_out"]:
        dims = ", ".join(str(v) for v in row["shape"].values())
        out.append(
            f"| {row['variant']} | {dims} | {row['checks']} | {100 * row['saved_max_rel']:.3f}% | "
            f"{100 * row['transient_max_rel']:.3f}% | {100 * row['static_max_rel']:.3f}% | "
            f"{row['worst']} |"
        )
    return out


# (recompute, SP, Korthikanti et al. bytes per layer / (s*b*h) with flash attention: no as²b term,
# as their selective-recompute formula), t = 8
SETTINGS = (
    ("none", False, lambda a, s, h, f, t: 10 + 24 / t),
    ("none", True, lambda a, s, h, f, t: 34 / t),
    ("full", True, lambda a, s, h, f, t: 2 / t),
)
FLASH = Kernels(attention_backend="flash")
"""The GPU kernel set of the comparison: Transformer Engine layers, flash attention."""


def korthikanti_rows(data: dict) -> list[str]:
    """Profiled bytes one layer keeps per micro-batch on the GPU kernel set with flash attention
    (TP 8, bf16, b = 1; with full recompute its stored input) vs Korthikanti et al.'s 34·sbh."""
    out = [
        "| model | recompute | SP | profiled (MiB) | Korthikanti, flash (MiB) | "
        "profiled / Korthikanti | profiled - Korthikanti (sbh/t) |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in data["results"]:
        shape = preset(res["preset"])
        z = ProbeShape.of(shape, 8, 1)
        needs = frozenset((Variant.of(shape, rc, sp), z) for rc, sp, _ in SETTINGS)
        model = profiled_model(shape, "fake-cuda", FLASH, needs, progress=False)
        sbh = shape.seq_length * shape.hidden_size
        dims = (shape.num_attention_heads, shape.seq_length, shape.hidden_size, shape.ffn, 8)
        for rc, sp, korthikanti in SETTINGS:
            c = find_variant(model, Variant.of(shape, rc, sp)).constants(shape_sizes(z))
            saved = c.layer_saved_rc_next if rc == "full" else c.layer_saved
            k = korthikanti(*dims) * sbh
            out.append(
                f"| {res['preset']} | {rc} | {'yes' if sp else 'no'} | {saved / 2**20:.1f} | "
                f"{k / 2**20:.1f} | {saved / k:.2f} | {(saved - k) / (sbh / 8):+.2f} |"
            )
    return out


KORTHIKANTI = {False: "10·sbh + 24·sbh/t + 5·as²b/t", True: "34·sbh/t + 5·as²b/t"}
"""Korthikanti et al.'s bytes per layer without recompute, by sequence parallelism (selective: no
as²b)."""


def breakdown_tables(data: list) -> list[str]:
    """Per recompute/SP setting, every tensor one GPT layer keeps (bench/saved_breakdown.py)."""
    out = []
    for setting in data:
        t = setting["totals"]
        formula = KORTHIKANTI[setting["sp"]]
        if setting["recompute"] == "selective":
            formula = formula.replace(" + 5·as²b/t", "")
        out += [
            f"### {setting['arch']}, recompute {setting['recompute']}, "
            f"SP {'on' if setting['sp'] else 'off'}",
            "",
        ]
        if setting["arch"] == "gpt":
            out += [
                f"Kept at GPT-3 1.3B's shape (TP 8, b = 1), with the layer's fp32 output: "
                f"{t['sbh']:g}·sbh + {t['sbh/t']:g}·sbh/t + {t['as2b/t']:g}·as²b/t + small terms "
                f"(b·s, s², s·d); Korthikanti: {formula}.",
                "",
            ]
        out += [
            "| op that allocated it | bytes | kept at GPT-3 1.3B / TP 8 | kept only when |",
            "|---|---|---|---|",
        ]
        out += [
            f"| {x['op']} | {x['bytes']} | {'yes' if x['at_reference'] else 'no'} | "
            f"{x['when'].strip() or '-'} |"
            for x in setting["tensors"]
        ]
        out.append("")
    return out


def _cell(text: str) -> str:
    """Text inside a markdown table cell (pipes escaped)."""
    return text.replace("|", "\\|")


def conformance_tables(data: dict) -> list[str]:
    """Megatron-LM's functional tests: predicted vs measured last-stage peak, per set."""
    out = []
    for title, held in (("Development cases", False), ('Held-out cases ("resume")', True)):
        rows = [r for r in data["cases"] if r["held_out"] == held]
        summary = data["summary"]["held_out" if held else "development"]
        worst, median = summary["max_abs_error"], summary["median_abs_error"]
        out += [
            f"### {title}",
            "",
            f"{summary['cases']} predicted: worst |error| "
            f"{'n/a' if worst is None else f'{100 * worst:.2f}%'}, median "
            f"{'n/a' if median is None else f'{100 * median:.2f}%'}; {summary['refused']} refused.",
            "",
            "| case | GPUs | measured GiB | predicted GiB | error | routing factor | worst-case "
            "bound GiB | layout / why refused |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            gpus = r.get("world_size") or "-"
            if "error" in r:
                bound = f"{r['bound'] / 2**30:.3f}" if "bound" in r else "-"
                factor = f"{r['factor']:g} (bound {r['bound_factor']:g})" if "factor" in r else "-"
                out.append(
                    f"| {r['name']} | {gpus} | {r['measured'] / 2**30:.3f} | "
                    f"{r['predicted'] / 2**30:.3f} | {100 * r['error']:+.2f}% | {factor} | "
                    f"{bound} | `{_cell(r['layout'])}` |"
                )
            else:
                why = (r.get("refused") or r.get("skipped") or "").replace("|", "/")
                measured = f"{r['measured'] / 2**30:.3f}"
                out.append(f"| {r['name']} | {gpus} | {measured} | - | - | - | - | {why} |")
        out.append("")
    return out


def plan_times_table(data: dict) -> list[str]:
    """Cold and warm `plan` times of the presets and the `profile` time (bench/plan_times.py)."""
    out = [
        "## How long a user waits (bench/plan_times.py; medians, fresh process each run)",
        "",
        "Default objective (the fastest plan that fits), GPUs of 80 GiB, fake-CUDA memory model. "
        "Cold: an empty cache (the fake-CUDA shim, compiled once per machine in a few seconds, "
        "excluded); warm: the same command again. Probes: the fake-CUDA probes the cold run "
        "profiled (the search profiles only what it visits).",
        "",
        "| model | GPUs | cold plan | warm plan | probes |",
        "|---|---|---|---|---|",
    ]
    for row in data["plans"]:
        out.append(
            f"| {row['preset']} | {row['gpus']} | {row['cold_s']:.1f} s | {row['warm_s']:.1f} s | "
            f"{row['probes']}{' (rerun at ' + row['rerun'] + ')' if 'rerun' in row else ''} |"
        )
    out += [
        "",
        f"`capture-megatron profile` of Llama-2-70B (TP 8 + SP, fake CUDA, fresh cache): "
        f"{data['profile_llama2_70b_s']:.1f} s with the design shapes (shipped for this "
        f"variant; loading them and writing the records with their timelines is most of it), "
        f"{data['profile_llama2_70b_no_design_s']:.1f} s with --no-design (the model's own sizes "
        "only: what `plan` needs, not enough to fit other sizes).",
    ]
    if "load_average_5min" in data:
        start, end = data["load_average_5min"]
        out.append(
            f"Measured on {data['workers']} cores with other work running: 5-minute load average "
            f"{start:.1f} at the start, {end:.1f} at the end."
        )
    if "rerun_load_average_5min" in data:
        start, end = data["rerun_load_average_5min"]
        out.append(
            f"Rows marked rerun were measured again at that commit: load average {start:.1f} at "
            f"the start, {end:.1f} at the end. The others were committed in a3c0acd, before the "
            "search space grew (every VPP count, micro-batches up to memory, CP): today's times "
            "for them are longer (the cold Llama 3 70B plan went from 59 s to 417 s at 61fcf93; "
            "the profiling workers kept between rounds brought it to 363 s, measuring each "
            "chunk once to 322 s)."
        )
    return out + issue53_table(data)


def issue53_table(data: dict) -> list[str]:
    """Issue 53's four models (bench/plan_times.py --issue53) and where a plan's time went."""
    rows, notes = data.get("issue53", []), data.get("issue53_notes", [])
    if not rows and not notes:
        return []
    out = [
        "",
        "### Issue 53's models (`bench/plan_times.py --issue53`: seq 4096, global batch 1024, "
        "80 GiB)",
        "",
        "Target: cold at most 60 s, warm at most 5 s, on this 2-core machine, idle. Cold: an "
        "empty user cache, with the anchor records the package ships for these plans "
        "(capture_megatron/profile/anchors, written by bench/ship_anchors.py); from nothing: "
        "the same with them left unread (CAPTURE_MEGATRON_SHIPPED=0, --from-nothing), every "
        "probe run; probes: that run's. Warm: the same command again, its answer read back "
        "(kept by the cold run in the cache: capture_megatron.api.kept; the same output but "
        "for the line saying so, checked: `same`); warm searched: once more with "
        "CAPTURE_MEGATRON_KEEP_PLANS=0, the plan worked out again from the cached records "
        "(what another question on the same model costs). Each row's runs and the 5-minute "
        "load average at its start and end (the machine was shared).",
        "",
        "| model | GPUs | cold plan | from nothing | warm plan | same | warm searched | probes "
        "| runs (cold; from nothing; warm; warm searched) | load | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cold, nothing = (
            f"{r[k]:.1f} s" if k in r else "-" for k in ("cold_s", "cold_from_nothing_s")
        )
        runs = "; ".join(
            ", ".join(f"{s:.{digits}f}" for s in r.get(key, [])) or "-"
            for key, digits in (
                ("cold_runs_s", 0),
                ("cold_from_nothing_runs_s", 0),
                ("warm_runs_s", 1),
                ("warm_searched_runs_s", 1),
            )
        )
        load = " -> ".join(f"{x:.1f}" for x in r.get("load_average_5min", []))
        warm, searched = (f"{r[k]:.1f} s" if k in r else "-" for k in ("warm_s", "warm_searched_s"))
        same = {True: "yes", False: "**no**"}.get(r.get("warm_read_back_same"), "-")
        out.append(
            f"| {r['model']} | {r['gpus']} | {cold} | {nothing} | {warm} | {same} | {searched} "
            f"| {r.get('probes', '-')} | {runs} | {load} | {r.get('commit', '')} |"
        )
    if not rows:
        out.append("| (not measured yet) | | | | | | | | | | |")
    return out + shipped_table() + [line for note in notes for line in ("", note)]


def shipped_table() -> list[str]:
    """The anchor records shipped for issue 53's plans (bench/ship_anchors.py)."""
    path = os.path.join(ROOT, "bench/results/ship_anchors.json")
    if not os.path.exists(path):
        return []
    out = [
        "",
        "The shipped anchor records (`bench/ship_anchors.py`: each plan run cold from nothing "
        "once, in a fresh cache; the records file it wrote, gzipped, is what the package ships):",
        "",
        "| plan | records | shipped | cold from nothing (one run) | load at its end | commit | "
        "conditions |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in json.loads(_read(path))["plans"]:
        out.append(
            f"| {r['plan']} | {r['records']} | {r['gzip_bytes'] / 1024:.0f} KiB | "
            f"{r['cold_from_nothing_s']:.0f} s | {r['load_average_5min_end']:.1f} | "
            f"{r['commit']} | {r.get('note', '')} |"
        )
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def main() -> None:
    part = json.loads(_read(os.path.join(ROOT, "bench/results/partitioners.json")))
    speed = json.loads(_read(os.path.join(ROOT, "bench/results/speed.json")))
    at, best = partitioner_tables(part)
    text = _read(os.path.join(ROOT, "bench/BENCHMARKS.head.md")).format(
        machine=f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        space=part["space"],
        gbs=part["global_batch_size"],
        **{k.replace("-", "_"): v for k, v in speed.items()},
    )
    times = os.path.join(ROOT, "bench/results/plan_times.json")
    if os.path.exists(times):
        text += "\n" + "\n".join(plan_times_table(json.loads(_read(times)))) + "\n"
    conformance = os.path.join(ROOT, "bench/results/conformance.json")
    if os.path.exists(conformance):
        text += (
            "\n## Conformance: Megatron-LM's functional tests (8 x H100, last pipeline stage)\n\n"
            + _read(os.path.join(ROOT, "bench/CONFORMANCE.md"))
            + "\n"
            + "\n".join(conformance_tables(json.loads(_read(conformance))))
        )
    text += versions_section(ROOT)
    text += inputs_section(ROOT)
    text += published_fit_section(ROOT)
    text += hf_planned_section(ROOT)
    text += moe_sections(ROOT)
    text += moe_vs_nvidia_section(ROOT)
    text += step_time_sections(ROOT)
    text += planner_sections(ROOT)
    text += "\n## Predicted worst-rank peak at CAPTURE's sizes\n\n" + "\n".join(at) + "\n"
    text += (
        "\n## Each approach at its own best sizes (lowest peak over TP/PP/DP)\n\n"
        + "\n".join(best)
        + "\n"
    )
    text += "\n## Fewest GPUs of 80 GiB that fit (1, 2, 4, then whole nodes of 8)\n\n" + "\n".join(
        min_gpu_table(part)
    )
    text += offload_sections(ROOT)
    text += gpu_sections(ROOT)
    text += rank_start_section(ROOT)
    text += (
        "\n\n## Profiling cost (probes for every TP the search considers; fresh cache)\n\n"
        + "\n".join(profile_cost_table(part))
    )
    quality = os.path.join(ROOT, "bench/results/profile_quality.json")
    if os.path.exists(quality):
        text += "\n\n" + "\n".join(quality_table(json.loads(_read(quality))))
    text += (
        "\n\n## Saved activations per layer vs Korthikanti et al. (2022), GPU kernel set\n\n"
        + _read(os.path.join(ROOT, "bench/KORTHIKANTI.md"))
        + "\n"
        + "\n".join(korthikanti_rows(part))
    )
    breakdown = os.path.join(ROOT, "bench/results/saved_breakdown.json")
    if os.path.exists(breakdown):
        text += (
            "\n\n## What one GPT layer keeps, tensor by tensor (bf16, local spec, CPU; "
            "bench/saved_breakdown.py)\n\n"
            + _read(os.path.join(ROOT, "bench/BREAKDOWN.md"))
            + "\n"
            + "\n".join(breakdown_tables(json.loads(_read(breakdown))))
        )
    text += "\n\n" + _read(os.path.join(ROOT, "bench/BENCHMARKS.tail.md"))
    with open(os.path.join(ROOT, "docs/BENCHMARKS.md"), "w") as f:
        f.write(text)
    print("wrote docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
