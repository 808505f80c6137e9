"""Issue 12, must-show 6: `plan` keeps what it was given. The layer implementation, attention
backend, recompute method and counts and every fixed size appear in its JSON and in its
`megatron_args` as given (profiled on the GPU kernel set, fake CUDA)."""

from __future__ import annotations

import json

import pytest
from test_cli_errors import cli

MODEL = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --vocab-size 512 --bf16 --hidden-dropout 0 --attention-dropout 0"
)
GIVEN = {
    "--transformer-impl": "local",
    "--attention-backend": "unfused",
    "--tensor-model-parallel-size": "2",
    "--pipeline-model-parallel-size": "2",
    "--micro-batch-size": "2",
    "--recompute-granularity": "full",
    "--recompute-method": "uniform",
    "--recompute-num-layers": "2",
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_plan_keeps_kernels_recompute_and_sizes(impl, tmp_path):
    given = dict(GIVEN, **{"--transformer-impl": impl})
    out = tmp_path / "plan.json"
    argv = ["plan", *MODEL.split(), *(x for kv in given.items() for x in kv), "--sequence-parallel"]
    argv += ["--gpus", "8", "--gpu-memory-gib", "80", "--device", "fake-cuda", "--no-progress"]
    done = cli([*argv, "--json", str(out)], str(tmp_path), CAPTURE_MEGATRON_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    args = data["megatron_args"]
    for flag, value in given.items():
        assert args[args.index(flag) + 1] == value, (flag, args)
    assert args.count("--sequence-parallel") == 1
    plan = data["plan"]
    assert (plan["tp"], plan["pp"], plan["micro_batch_size"]) == (2, 2, 2)
    assert plan["recompute"] == {"granularity": "full", "method": "uniform", "num_layers": [2, 2]}
    kernels = data["kernels"]
    assert (kernels["transformer_impl"], kernels["attention_backend"]) == (impl, "unfused")
    assert data["memory_model"]["kernels"].startswith("gpu:")
