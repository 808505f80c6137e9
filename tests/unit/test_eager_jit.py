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
