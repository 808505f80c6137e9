"""capture-megatron's own processes print no megatron-core warning that does not concern the user:
the filters of capture_megatron.megatron.quiet match what the real megatron-core modules warn, and
a cold `plan` (profiling included) prints nothing beyond its own lines. (`train` per rank:
tests/dist/test_quiet_train.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

WARNED = ("Warning", "warnings.warn", "WARNING", "Rerun State Machine", "RerunStateMachine")
"""What megatron-core's warnings and warning-level log lines contain."""
IMPORTS = (
    "import megatron.core.optimizer, megatron.core.optimizer.clip_grads, "
    "megatron.core.models.gpt.gpt_layer_specs, megatron.core.models.backends, "
    "megatron.core.distributed"
)
"""megatron-core modules that warn on import on a machine without Transformer Engine and Apex."""


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.slow  # two interpreters importing megatron-core
def test_quiet_filters_match_megatron_cores_own_warnings():
    loud = _python(IMPORTS)
    assert loud.count("not installed") >= 4, loud  # what the filters are for is really printed
    silent = _python("from capture_megatron.megatron import quiet; quiet.install(); " + IMPORTS)
    assert not [w for w in WARNED if w in silent], silent


def test_kernels_line_names_the_stand_ins():
    from capture_megatron.megatron.quiet import kernels_line

    line = kernels_line("local", "cpu")
    assert line.startswith("local spec on cpu")
    if "transformer_engine" not in sys.modules:  # this machine: neither TE nor Apex
        assert "no Transformer Engine or Apex: torch norms and optimizers" in line


@pytest.mark.slow
def test_a_cold_plan_prints_only_its_own_lines(tmp_path):
    model = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --vocab-size 512 --micro-batch-size 2 --global-batch-size 8"
    )
    done = subprocess.run(
        [sys.executable, "-m", "capture_megatron.cli", "plan", *model.split()]
        + "--gpus 2 --gpu-memory-gib 1 --device cpu --no-progress".split(),
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1", CAPTURE_MEGATRON_CACHE=str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"profiling \d+ probes on cpu", done.stdout)  # cold: the probes ran here
    assert "(memory model: cpu, kernels cpu, megatron-core " in done.stdout
    assert done.stderr == "", done.stderr[-3000:]
    assert not [w for w in WARNED if w in done.stdout], done.stdout
