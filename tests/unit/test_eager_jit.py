"""megatron-core's jit_fuser is switched off (megatron's own disable_jit_fuser) in CPU processes
before megatron-core is imported (capture_megatron.emulate.eager_jit): its fused functions run
eagerly, as the profiling workers measure them, and torch.compile's machinery is not imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from capture_megatron.emulate import eager_jit
assert eager_jit.install()
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
from megatron.core.models.gpt import GPTModel
import torch
x = torch.randn(4, 8)
assert torch.equal(bias_swiglu(x, torch.zeros(8)), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
print(eager_jit.eager(), "torch._dynamo" in sys.modules, eager_jit.install())
"""


@pytest.mark.slow  # a fresh interpreter importing megatron-core: a few seconds
def test_a_cpu_process_runs_megatrons_fused_functions_eagerly():
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CHECK], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # eager; torch.compile's machinery never imported; a second install is too late and says so
    assert done.stdout.split() == ["True", "False", "False"]


TRAIN = """
import sys
from capture_megatron.emulate import eager_jit
from capture_megatron.train import entry
rc = entry.main(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                 "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
                 "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
                 "--tokenizer-type", "ByteTokenizer", "--no-progress"])
print(rc, eager_jit.eager())
"""


@pytest.mark.slow  # one training step in a fresh interpreter: a few seconds
def test_a_cpu_training_process_is_eager_though_its_tokenizer_imports_megatron_first():
    # the tokenizer (read while the flags are parsed) imports megatron-core: the switch comes first
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", TRAIN], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["0", "True"], done.stdout[-3000:]
