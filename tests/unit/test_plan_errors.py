"""Plans that cannot be made: the error names the smallest setup that would fit, the CUDA margin,
or why no candidate exists (one line, exit code 2). These profile a small model (fake device)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# one worker runs the module (make test: --dist loadgroup), so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("plan_errors")]


SMALL = [
    "--num-layers",
    "24",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "512",
    "--vocab-size",
    "32000",
    "--bf16",
    "--device",
    "fake",
    "--no-progress",
]
FIXED = [
    "--tensor-model-parallel-size",
    "1",
    "--micro-batch-size",
    "1",
    "--recompute-granularity",
    "full",
    "--num-virtual-stages-per-pipeline-rank",
    "1",
    "--use-distributed-optimizer",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def plan(args: list[str], cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CAPTURE_MEGATRON_CACHE=cache)
    return subprocess.run(
        [sys.executable, "-m", "capture_megatron.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [
        ln for ln in done.stderr.splitlines() if ln.startswith("capture-megatron plan: error:")
    ]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def on_3_gib(gpus: int) -> list[str]:
    """The small model on `gpus` GPUs of 3 GiB, with a 2 GiB context margin, its optimizer kept on
    the device (--optimizer-offload-fraction 0: with offload searched one GPU holds it)."""
    budget = ["--gpu-memory-gib", "3", "--context-gib", "2", "--global-batch-size", "64"]
    budget += ["--optimizer-offload-fraction", "0"]
    return [*SMALL, *FIXED, "--gpus", str(gpus), *budget]


def test_impossible_budget_names_the_smallest_setup(cache):
    fits = plan(on_3_gib(8), cache)
    assert fits.returncode == 0, fits.stderr[-3000:]
    line = error_line(plan(on_3_gib(1), cache))
    assert "no plan fits 3 GiB on 1 GPUs" in line and "the smallest fitting setup is" in line, line
    gpus = int(line.split("the smallest fitting setup is ")[1].split()[0])
    assert 1 < gpus <= 8
    # and the setup it names does fit
    assert plan(on_3_gib(gpus), cache).returncode == 0


def test_budget_below_the_cuda_margin(cache):
    line = error_line(plan([*SMALL, *FIXED, "--gpus", "8", "--gpu-memory-gib", "1.5"], cache))
    assert "context and allocator margin alone take 3.9 GiB" in line, line


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--num-attention-heads", "15", "--hidden-size", "600"],
            "heads 15 / query groups 15 divide by none of TP",
        ),
        (["--num-layers", "2", "--pipeline-model-parallel-size", "4"], "layers 2 < PP 4"),
        (
            ["--num-experts", "8", "--expert-model-parallel-size", "8"]
            + ["--pipeline-model-parallel-size", "2"],
            "EP [8] x expert TP (= TP) must divide the TP x CP x DP ranks of a stage",
        ),
    ],
)
def test_shapes_no_plan_can_serve(cache, args, expected):
    base = [a for a in SMALL]
    for flag, value in zip(args[::2], args[1::2]):
        if flag in base:
            base[base.index(flag) + 1] = value
        else:
            base += [flag, value]
    line = error_line(
        plan(
            [*base, "--gpus", "8", "--gpu-memory-gib", "80", "--tensor-model-parallel-size", "4"]
            if "heads" in expected
            else [*base, "--gpus", "8", "--gpu-memory-gib", "80"],
            cache,
        )
    )
    assert expected in line, line
