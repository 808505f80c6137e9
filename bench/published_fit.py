"""Benchmark: do configurations NVIDIA published as run on 80 GB H100s fit, as `predict` forecasts
them (issue 51, must-show 4)?

The runs (tests/data/published_runs/README.md): Grok-1 314B at NVIDIA's dgxc-benchmarking v25.02
configuration (TP 4, PP 8, VP 8, CP 2, EP 8 on 512 GPUs; its BF16 and its default FP8 run), and
Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh on 8 GPUs as the script passes its flags
(CP 1) and as its README's performance table ran it (CP 2). Each line is forecast on the GPU kernel
set (profiled on the spot, cached); the variants change the flags named to show what they do.

    python bench/published_fit.py [--out bench/results/published_fit.json] [--device fake]
                                  [--cases NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from inputs import args_file

import capture_megatron
from capture_megatron.config import GIB
from capture_megatron.errors import CaptureError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


@dataclass(frozen=True)
class Case:
    """One forecast: a published line, or it with some flags changed."""

    name: str
    """Unique name."""
    file: str
    """The .args file under tests/data."""
    gpus: int
    """World size of the published run."""
    drop: tuple[str, ...] = ()
    """Flags (switches, or flags with their value) left out of the line."""
    add: tuple[str, ...] = ()
    """Flags added to (or, for a flag of the line, replacing the value in) the line."""
    note: str = ""
    """What the case shows."""


GROK_BF16 = "published_runs/grok1_314b_bf16_512.args"
GROK_FP8 = "published_runs/grok1_314b_fp8_512.args"
LLAMA = "megatron_lm_examples/train_llama3_8b_h100_fp8.args"
CASES = (
    Case("grok1-bf16", GROK_BF16, 512, note="dgxc v25.02 BF16 as run (published 21.01 s)"),
    Case("grok1-fp8", GROK_FP8, 512, note="dgxc v25.02 FP8 (its default) as run (16.90 s)"),
    Case(
        "grok1-bf16-dropless",
        GROK_BF16,
        512,
        drop=("--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity"),
        note="without the recipe's expert capacity 1.0 (dropless: the routing forecast's share)",
    ),
    Case(
        "grok1-bf16-fp32-grads",
        GROK_BF16,
        512,
        drop=("--grad-reduce-in-bf16",),
        note="without the recipe's bf16 gradient reduction (grad_sync_dtype: fp32 buffers)",
    ),
    Case("llama3-8b-fp8-script", LLAMA, 8, note="the script's flags: CP 1"),
    Case(
        "llama3-8b-fp8-readme",
        LLAMA,
        8,
        add=("--context-parallel-size", "2"),
        note="as its README's table ran it: CP 2 (13812 tokens/s/GPU)",
    ),
)
"""The forecasts, published lines first."""


def argv_of(case: Case) -> list[str]:
    """The case's command line: the file's flags with `drop` left out and `add` applied."""
    argv = args_file(os.path.join(DATA, case.file))
    out: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if flag in case.drop or flag in case.add[::2]:
            i += 2 if value else 1
            continue
        out.append(flag)
        i += 1
    return out + list(case.add)


def forecast(case: Case, device: str) -> dict[str, Any]:
    """The case's forecast: every rank's peak, the worst rank's need and breakdown, or why it is
    refused."""
    argv = [*argv_of(case), "--gpus", str(case.gpus), "--gpu-memory-gib", "80", "--no-progress"]
    argv += ["--device", device] if device else []
    row: dict[str, Any] = {"name": case.name, "file": case.file, "note": case.note}
    try:
        result = capture_megatron.predict(argv)
    except CaptureError as err:
        return {**row, "refused": str(err)}
    best = result.best
    worst = max(range(len(best.stages)), key=lambda r: best.stages[r].peak)
    stage = best.stages[worst]
    return {
        **row,
        "peak_gib": best.peak / GIB,
        "needed_gib": best.needed / GIB,
        "fits": best.fits,
        "worst_rank": worst,
        "phase": stage.phase,
        "inflight": list(stage.inflight),
        "breakdown_gib": {
            k: getattr(stage, k) / GIB
            for k in ("params", "grads", "optimizer", "activations", "transient", "other")
        },
        "rank_peaks_gib": [s.peak / GIB for s in best.stages],
        "layout": best.plan.layout,
    }


def main() -> None:
    """Forecast every case and write the results."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "published_fit.json"))
    ap.add_argument("--device", default="", help="memory model device (default: the planner's)")
    ap.add_argument("--cases", default="", help="comma-separated case names: only these")
    ns = ap.parse_args()
    chosen = [c for c in CASES if not ns.cases or c.name in ns.cases.split(",")]
    rows = [forecast(c, ns.device) for c in chosen]
    with open(ns.out, "w") as f:
        json.dump({"device": ns.device or "default", "cases": rows}, f, indent=1)
    for r in rows:
        tail = r.get("refused") or (
            f"peak {r['peak_gib']:.1f} GiB on rank {r['worst_rank']} ({r['phase']}), need "
            f"{r['needed_gib']:.1f}, fits {r['fits']}"
        )
        print(f"{r['name']:26s} {tail}", file=sys.stdout)


if __name__ == "__main__":
    main()
