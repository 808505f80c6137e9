"""Render docs/BENCHMARKS.md from bench/results/*.json (run the benches first; nothing is typed in).

    python bench/report.py
"""
from __future__ import annotations

import json
import os
import platform

from capture_megatron import presets
from capture_megatron.config import ParallelPlan, Recompute
from capture_megatron.model_source import profiled_model
from capture_megatron.predict import find_variant, sizes_for, variant_of
from capture_megatron.profile.requests import anchor_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("capture", "uniform", "megatron-first-last", "deepspeed-parameters")


def _gib(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _less(ours, theirs) -> str:
    return "" if theirs is None or not theirs else f" ({100 * (1 - ours / theirs):.0f}%)"


def partitioner_tables(data: dict) -> list[str]:
    out = ["| model | GPUs | CAPTURE sizes | CAPTURE GiB | uniform GiB | Megatron first/last GiB | "
           "DeepSpeed 'parameters' GiB |", "|---|---|---|---|---|---|---|"]
    best = ["| model | GPUs | CAPTURE | uniform | Megatron first/last | DeepSpeed 'parameters' |",
            "|---|---|---|---|---|---|"]
    for res in data["results"]:
        for row in res["rows"]:
            if "sizes" not in row:
                continue
            at, own = row["at_capture_sizes_gib"], row["best_sizes_gib"]
            cap = at["capture"]
            out.append(f"| {res['preset']} | {row['gpus']} | {row['sizes']} | {_gib(cap)} | "
                       + " | ".join(f"{_gib(at[n])}{_less(cap, at[n])}" for n in NAMES[1:]) + " |")
            best.append(f"| {res['preset']} | {row['gpus']} | "
                        + " | ".join(f"{_gib(own.get(n))}{_less(own['capture'], own.get(n)) if n != 'capture' else ''}"
                                     for n in NAMES) + " |")
    return out, best


def min_gpu_table(data: dict) -> list[str]:
    out = ["| model | CAPTURE | uniform | Megatron first/last | DeepSpeed 'parameters' |", "|---|---|---|---|---|"]
    for res in data["results"]:
        out.append(f"| {res['preset']} | " + " | ".join(str(res["min_gpus"][n]) for n in NAMES) + " |")
    return out


def profile_cost_table(data: dict) -> list[str]:
    out = ["| model | layers | probe runs (fake, this CPU) | seconds (profile + fit) | mCAP-style runs (~1 per layer) |",
           "|---|---|---|---|---|"]
    for res in data["results"]:
        out.append(f"| {res['preset']} | {res['layers']} | {res['probes']} | {res['profile_and_fit_seconds']:.1f} | "
                   f"{res['layers']} per configuration, on the target GPUs |")
    return out


def korthikanti_rows(data: dict) -> list[str]:
    """Our profiled bytes one layer saves (TP 8, SP, selective, bf16, b=1) vs Korthikanti et al.'s 34sbh/t."""
    out = ["| model | profiled S (MiB) | Korthikanti 34·s·b·h/t (MiB) | theoretical_memory_usage (18+4f/h)·s·b·h/t (MiB) "
           "| S / Korthikanti |", "|---|---|---|---|---|"]
    for res in data["results"]:
        shape = presets.preset(res["preset"])
        plan = ParallelPlan(tp=8, pp=1, dp=1, micro_batch_size=1, global_batch_size=1,
                            layers_per_stage=(shape.num_layers,), sequence_parallel=True,
                            recompute=Recompute("selective"))
        model = profiled_model(shape, "fake", {(variant_of(shape, plan), anchor_shape(shape, 8, 1))}, progress=False)
        saved = find_variant(model, variant_of(shape, plan)).constants(sizes_for(shape, plan)).layer_saved
        formula = 34 * shape.seq_length * shape.hidden_size / 8
        megatron = (18 + 4 * shape.ffn / shape.hidden_size) * shape.seq_length * shape.hidden_size / 8
        out.append(f"| {res['preset']} | {saved / 2**20:.1f} | {formula / 2**20:.1f} | {megatron / 2**20:.1f} | "
                   f"{saved / formula:.2f} |")
    return out


def main() -> None:
    part = json.load(open(os.path.join(ROOT, "bench/results/partitioners.json")))
    speed = json.load(open(os.path.join(ROOT, "bench/results/speed.json")))
    at, best = partitioner_tables(part)
    text = open(os.path.join(ROOT, "bench/BENCHMARKS.head.md")).read().format(
        machine=f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        space=part["space"], gbs=part["global_batch_size"], **{k.replace("-", "_"): v for k, v in speed.items()})
    text += "\n## Predicted worst-rank peak at CAPTURE's sizes\n\n" + "\n".join(at) + "\n"
    text += "\n## Each approach at its own best sizes (lowest peak over TP/PP/DP)\n\n" + "\n".join(best) + "\n"
    text += "\n## Fewest GPUs of 80 GiB that fit (1, 2, 4, then whole nodes of 8)\n\n" + "\n".join(min_gpu_table(part))
    text += "\n\n## Profiling cost (probes for every TP the search considers; fresh cache)\n\n" + "\n".join(
        profile_cost_table(part))
    text += "\n\n## Saved activations per layer vs Korthikanti et al. (2022)\n\n" + "\n".join(korthikanti_rows(part))
    text += "\n\n" + open(os.path.join(ROOT, "bench/BENCHMARKS.tail.md")).read()
    with open(os.path.join(ROOT, "docs/BENCHMARKS.md"), "w") as f:
        f.write(text)
    print("wrote docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
