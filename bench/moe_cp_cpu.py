"""Forecast vs measured for mixture-of-experts and context-parallel runs on the CPU kernel set:
`capture-megatron verify` (real torchrun + gloo, megatron-core's MoE layers, the all-gather CP
attention) per case, and for dropless routing the default forecast (measured routing statistics),
its planning margin and the worst-case bound against the measured peak of several seeds. Writes
bench/results/moe_cp_cpu.json (rendered by bench/report.py).

python bench/moe_cp_cpu.py [--dropless-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --vocab-size 512 --micro-batch-size 2 --global-batch-size 8 "
    "--disable-bias-linear --recompute-granularity none --num-virtual-stages-per-pipeline-rank 1"
)
EXPERTS = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall"
PADDED = f"{EXPERTS} --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"
CASES = (  # (name, flags, processes)
    ("EP2, capacity-padded", f"{PADDED} --expert-model-parallel-size 2", 2),
    (
        "EP2 x PP2, capacity-padded",
        f"{PADDED} --expert-model-parallel-size 2 --pipeline-model-parallel-size 2",
        4,
    ),
    (
        "EP2 x TP2 + SP, capacity-padded",
        f"{PADDED} --expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
        "--sequence-parallel",
        4,
    ),
    (
        "EP2, capacity-padded, full recompute of all 4 layers",
        f"{PADDED} --expert-model-parallel-size 2 --recompute-granularity full "
        "--recompute-method block --recompute-num-layers 4",
        2,
    ),
    (
        "EP2 x PP2, capacity-padded, full recompute of 1 of 2 layers",
        f"{PADDED} --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
        4,
    ),
    ("CP2", "--context-parallel-size 2", 2),
    ("CP2 x PP2", "--context-parallel-size 2 --pipeline-model-parallel-size 2", 4),
    (
        "CP2 x TP2 + SP",
        "--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
        4,
    ),
)
DROPLESS = f"{EXPERTS} --moe-aux-loss-coeff 0.01 --expert-model-parallel-size 2"
SEEDS = (1, 2, 3, 4, 5)


def _cli(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "capture-megatron")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"capture-megatron {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def _run(flags: str, nproc: int, cwd: str, *extra: str) -> dict:
    """The verify JSON of one run (--tolerance 1: the bench reports the error, it does not fail)."""
    out = os.path.join(cwd, "verify.json")
    run = ["--nproc", str(nproc), "--device", "cpu", "--mock-data", "--train-iters", "2"]
    _cli(
        [
            "verify",
            *MODEL.split(),
            *flags.split(),
            *run,
            *extra,
            "--tolerance",
            "1",
            "--no-progress",
            "--json",
            out,
        ],
        cwd,
    )
    with open(out) as f:
        return json.load(f)


def _case_row(name: str, flags: str, nproc: int, cwd: str) -> dict:
    got = _run(flags, nproc, cwd)
    return {
        "case": name,
        "processes": nproc,
        "predicted_mib": [r["predicted_bytes"] / 2**20 for r in got["ranks"]],
        "measured_mib": [r["measured_bytes"] / 2**20 for r in got["ranks"]],
        "max_abs_error": got["max_abs_error"],
    }


def _seed_row(seed: int, cwd: str) -> dict:
    got = _run(DROPLESS, 2, cwd, "--seed", str(seed))
    routing = got["moe_routing"]
    return {
        "seed": seed,
        "forecast_mib": max(r["predicted_bytes"] for r in got["ranks"]) / 2**20,
        "planning_mib": max(routing["planning_peak_bytes"]) / 2**20,
        "bound_mib": max(routing["bound_peak_bytes"]) / 2**20,
        "measured_mib": max(r["measured_bytes"] for r in got["ranks"]) / 2**20,
        "factors": [routing[f"{k}_factor"] for k in ("forecast", "planning", "bound")],
    }


def main() -> None:
    """Run the cases and seeds (--dropless-only: the seeds, keeping the cases written before)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dropless-only", action="store_true")
    ns = ap.parse_args()
    path = os.path.join(ROOT, "bench/results/moe_cp_cpu.json")
    cases = [] if ns.dropless_only else list(CASES)
    rows: list[dict] = []
    if ns.dropless_only:
        with open(path) as f:
            rows = json.load(f)["cases"]
    with tempfile.TemporaryDirectory() as cwd, tqdm(total=len(cases) + len(SEEDS)) as bar:
        for name, flags, nproc in cases:
            rows.append(_case_row(name, flags, nproc, cwd))
            bar.update()
        seeds = []
        for seed in SEEDS:
            seeds.append(_seed_row(seed, cwd))
            bar.update()
    with open(path, "w") as f:
        json.dump(
            {"model": MODEL, "cases": rows, "dropless": DROPLESS, "seeds": seeds}, f, indent=1
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
