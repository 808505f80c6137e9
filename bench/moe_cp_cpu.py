"""Forecast vs measured for mixture-of-experts and context-parallel runs on the CPU kernel set:
`capture-megatron verify` (real torchrun + gloo, megatron-core's MoE layers, the all-gather CP
attention) per case, and for dropless routing the stated bound against the measured peak of several
seeds. Writes bench/results/moe_cp_cpu.json (rendered by bench/report.py).

python bench/moe_cp_cpu.py
"""

from __future__ import annotations

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


def main() -> None:
    rows, seeds = [], []
    with tempfile.TemporaryDirectory() as cwd, tqdm(total=len(CASES) + len(SEEDS)) as bar:
        for name, flags, nproc in CASES:
            got = _run(flags, nproc, cwd)
            rows.append(
                {
                    "case": name,
                    "processes": nproc,
                    "predicted_mib": [r["predicted_bytes"] / 2**20 for r in got["ranks"]],
                    "measured_mib": [r["measured_bytes"] / 2**20 for r in got["ranks"]],
                    "max_abs_error": got["max_abs_error"],
                }
            )
            bar.update()
        for seed in SEEDS:
            got = _run(DROPLESS, 2, cwd, "--seed", str(seed))
            seeds.append(
                {
                    "seed": seed,
                    "bound_mib": max(r["predicted_bytes"] for r in got["ranks"]) / 2**20,
                    "measured_mib": max(r["measured_bytes"] for r in got["ranks"]) / 2**20,
                }
            )
            bar.update()
    path = os.path.join(ROOT, "bench/results/moe_cp_cpu.json")
    with open(path, "w") as f:
        json.dump(
            {"model": MODEL, "cases": rows, "dropless": DROPLESS, "seeds": seeds}, f, indent=1
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
