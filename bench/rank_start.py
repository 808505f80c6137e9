"""Benchmark: what starting a CPU training job costs, torchrun's ranks as Pythons of their own
(`torchrun -m capture_megatron.pretrain_gpt`, what GPU machines and the Slurm scripts use) against
ranks forked from a torchrun that imported torch and megatron-core once (train.preloaded, what
`capture-megatron train`, `verify` and `demo` use without CUDA). A tiny GPT (4 layers, hidden 64,
2 iterations on mock data) on 2 and 4 ranks; each job's wall seconds and the CPU seconds of it and
everything it started, both ways alternately, medians of --repeats runs. Each pair's losses and
per-rank measured peaks must be equal (the script stops otherwise).

    python bench/rank_start.py [--repeats 5] [--out bench/results/rank_start.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from capture_megatron.train.launch import torchrun_command
from capture_megatron.train.report import MemoryReport

MODEL = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512"),
    *("--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data"),
    *("--train-iters", "2", "--no-progress"),
]


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def one_job(nproc: int, fork: bool, workdir: str) -> tuple[float, float, MemoryReport]:
    """Wall and CPU seconds of one job, and its memory report."""
    report = os.path.join(workdir, f"{'fork' if fork else 'exec'}-{nproc}.json")
    args = [*MODEL, "--pipeline-model-parallel-size", str(nproc), "--memory-report", report]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cpu0, t0 = _children_cpu(), time.perf_counter()
    subprocess.run(
        torchrun_command(nproc, args, fork=fork), env=env, cwd=workdir, check=True,
        capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - t0, _children_cpu() - cpu0, MemoryReport.read(report)


def measure(nproc: int, repeats: int) -> dict:
    """Medians for both ways of starting `nproc` ranks."""
    runs: dict[str, list[tuple[float, float]]] = {"exec": [], "fork": []}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(repeats):
            reports = {}
            for way in ("exec", "fork"):
                wall, cpu, reports[way] = one_job(nproc, way == "fork", workdir)
                runs[way].append((wall, cpu))
            same = reports["exec"].ranks == reports["fork"].ranks and [
                i.loss for i in reports["exec"].iterations
            ] == [i.loss for i in reports["fork"].iterations]
            if not same:
                raise SystemExit(f"{nproc} ranks: the two ways measured differently")
    row: dict = {"ranks": nproc, "repeats": repeats}
    for way, values in runs.items():
        row[f"{way}_wall_s"] = round(statistics.median(v[0] for v in values), 2)
        row[f"{way}_cpu_s"] = round(statistics.median(v[1] for v in values), 2)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/rank_start.json")
    ns = parser.parse_args()
    rows = [measure(n, ns.repeats) for n in (2, 4)]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    load = os.getloadavg()[1] if hasattr(os, "getloadavg") else None
    with open(ns.out, "w") as f:
        json.dump({"machine": machine, "load_average_5min": load, "rows": rows}, f, indent=1)
        f.write("\n")
    print(f"wrote {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
