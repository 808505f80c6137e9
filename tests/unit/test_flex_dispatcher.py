"""--moe-token-dispatcher-type flex (DeepEP / HybridEP) is refused by `predict` and `plan` with
one paragraph naming the flag and the alternative, before any probe (megatron-core's own error
about padding the forecast's routing bound never asked for used to leak out)."""

from __future__ import annotations

import pytest
from test_cli_errors import cli, one_error

MOE = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 64 --vocab-size 256 --micro-batch-size 1 "
    "--global-batch-size 4 --bf16 --num-experts 4 --moe-router-topk 2 --disable-bias-linear "
    "--expert-model-parallel-size 2 --moe-token-dispatcher-type flex --gpus 2 --no-progress"
).split()


@pytest.mark.parametrize("command", ["predict", "plan"])
@pytest.mark.parametrize("device", ["cpu", "fake-cuda"])
def test_flex_is_one_paragraph(command, device, tmp_path):
    extra = ["--gpu-memory-gib", "80"] if command == "plan" else []
    done = cli([command, *MOE, "--device", device, *extra], str(tmp_path))
    line = one_error(done, command)
    assert "--moe-token-dispatcher-type flex is not modelled" in line
    assert "DeepEP" in line and "--moe-token-dispatcher-type alltoall" in line
    assert "profiling" not in done.stdout + done.stderr
