"""Issue 12, must-show 2 (the paste test): the pretrain_gpt.py flags of two of Megatron-LM's own
launch scripts (tests/data/megatron_lm_examples, paths replaced) given verbatim to `plan` and
`predict` run, or are refused only for the flags that change memory in a way not modelled, each
one named."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from test_cli_errors import cli

EXAMPLES = Path(__file__).parents[1] / "data" / "megatron_lm_examples"


def flags_of(name: str) -> list[str]:
    """The example's flags, one per line as the script passes them."""
    lines = (EXAMPLES / f"{name}.args").read_text().splitlines()
    return [w for ln in lines if ln and not ln.startswith("#") for w in shlex.split(ln)]


def run(command: str, argv: list[str], gpus: int, tmp_path: Path):
    out = tmp_path / f"{command}.json"
    extra = ["--gpu-memory-gib", "80"] if command == "plan" else []
    argv = [command, *argv, "--gpus", str(gpus), *extra, "--no-progress", "--json", str(out)]
    return cli(argv, str(tmp_path), CAPTURE_MEGATRON_CACHE=str(tmp_path / "cache")), out


@pytest.mark.slow
@pytest.mark.parametrize("command", ["predict", "plan"])
def test_gpt3_175b_runs_verbatim(command, tmp_path):
    done, out = run(command, flags_of("train_gpt3_175b_distributed"), 128, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    args = data["megatron_args"]
    assert args[args.index("--tensor-model-parallel-size") + 1] == "8"
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "16"
    assert args[args.index("--global-batch-size") + 1] == "1536"
    assert "--fp16" in data["model_args"] and data["model"]["num_layers"] == 96
    assert len(data["predicted_peak_bytes"]) == 16
    assert "--rampup-batch-size" in data["ignored_flags"]
    assert any("GPT-2" in n for n in data["notes"])  # its vocab file is not readable here


@pytest.mark.slow
@pytest.mark.parametrize("command", ["predict", "plan"])
def test_llama3_8b_fp8_runs_verbatim(command, tmp_path):
    """Megatron-LM's Llama 3 8B FP8 example (hybrid delayed scaling, amax history 1024, FP8
    parameters all-gathered, bf16 gradients) is forecast as given, its FP8 settings emitted."""
    done, out = run(command, flags_of("train_llama3_8b_h100_fp8"), 8, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["kernels"]["attention_backend"] == "fused"
    assert data["kernels"]["cross_entropy_loss_fusion"] is True
    assert data["plan"]["distributed_optimizer"] is True
    assert any("--sequence-parallel is off at TP 1" in n for n in data["notes"])
    fp8 = ["--fp8-format", "hybrid", "--fp8-param-gather", "--fp8-amax-history-len", "1024"]
    args = data["megatron_args"]
    assert all(a in args for a in fp8) and args[args.index("--fp8-format") + 1] == "hybrid"
    assert "--grad-reduce-in-bf16" in args
    assert data["memory_model"]["kernels"].endswith("/fp8-delayed/fp8-params/amax1024")
    assert "--fp8-amax-compute-algo" in data["ignored_flags"]
