"""Run capture-megatron training jobs under real torchrun for the distributed tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from capture_megatron.train.launch import torchrun_command
from capture_megatron.train.report import MemoryReport

# The 4-layer sizes the forecast tests of issue 26 (attention, MoE, MTP) build their models on.
SMALL_SHAPE = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "512"),
    *("--micro-batch-size", "2", "--global-batch-size", "8"),
]

# A tiny GPT every equivalence test shares (dropout off so every plan computes the same function).
TINY = [
    "--num-layers",
    "8",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--vocab-size",
    "512",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--lr",
    "1e-3",
    "--lr-decay-iters",
    "6",
    "--no-progress",
    "--seed",
    "7",
]


@dataclass(frozen=True)
class Run:
    """A finished torchrun job."""

    returncode: int
    """torchrun's exit code."""
    output: str
    """stdout and stderr together."""
    report: MemoryReport | None
    """The --memory-report, when the job wrote one."""


def train(
    nproc: int,
    args: list[str],
    workdir: str,
    name: str,
    timeout: float = 300,
    env: dict | None = None,
    fork: bool = True,
) -> Run:
    """Run pretrain_gpt on `nproc` gloo ranks with --memory-report, forked from a preloaded
    torchrun as `capture-megatron train` starts them on a machine without CUDA (`fork` False:
    each rank a Python of its own, as on a GPU machine); returns the finished Run."""
    return _run(lambda a: torchrun_command(nproc, a, fork=fork), args, workdir, name, timeout, env)


def train_single(args: list[str], workdir: str, name: str, timeout: float = 300) -> Run:
    """Run pretrain_gpt as one process without a launcher (its 'single' mode: a gloo group of one,
    what a one-rank torchrun job gets, without torchrun's few seconds of start-up)."""
    return _run(
        lambda a: [sys.executable, "-m", "capture_megatron.pretrain_gpt", *a],
        args,
        workdir,
        name,
        timeout,
        None,
    )


def _run(command, args: list[str], workdir: str, name: str, timeout: float, env) -> Run:
    report_path = os.path.join(workdir, f"{name}.json")
    cmd = command([*args, "--memory-report", report_path])
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=workdir
    )
    output = proc.stdout + proc.stderr
    report = MemoryReport.read(report_path) if os.path.exists(report_path) else None
    return Run(proc.returncode, output, report)


def cli(
    args: list[str], timeout: float = 300, cwd: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the capture-megatron console entry point in a fresh interpreter (`env`: added to
    this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "capture_megatron.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
    )


def verify_on_cpu(flags: list[str], workdir, nproc: int) -> dict:
    """`capture-megatron verify` of `flags` on the CPU (nproc torchrun processes, mock data, 2
    iterations): the run must succeed; its JSON (forecast against measured, per rank)."""
    out = os.path.join(str(workdir), "verify.json")
    run = ["--nproc", str(nproc), "--device", "cpu", "--mock-data", "--train-iters", "2"]
    done = cli(
        ["verify", *flags, *run, "--no-progress", "--json", out], timeout=600, cwd=str(workdir)
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def losses(run: Run) -> list[float]:
    """Per-iteration losses of a successful run (fails loudly with the output otherwise)."""
    assert run.returncode == 0 and run.report is not None, run.output[-4000:]
    return [it.loss for it in run.report.iterations]


def grad_norms(run: Run) -> list[float]:
    """Per-iteration gradient norms of a successful run."""
    assert run.returncode == 0 and run.report is not None, run.output[-4000:]
    return [it.grad_norm for it in run.report.iterations]
