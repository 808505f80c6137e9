"""Issue 12, must-show 2 (the paste test): the pretrain_gpt.py flags of two of Megatron-LM's own
launch scripts (tests/data/megatron_lm_examples, paths replaced) given verbatim to `plan` and
`predict` run, or are refused only for the flags that change memory in a way not modelled, each
one named."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from test_cli_errors import cli, one_error

EXAMPLES = Path(__file__).parents[1] / "data" / "megatron_lm_examples"
NOT_MODELLED_LLAMA = {
    "--fp8-format",
    "--fp8-amax-history-len",
    "--fp8-amax-compute-algo",
    "--fp8-param-gather",
}


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
def test_llama3_8b_fp8_is_refused_for_fp8_only(command, tmp_path):
    argv = flags_of("train_llama3_8b_h100_fp8")
    done, _ = run(command, argv, 8, tmp_path)
    line = one_error(done, command)
    named = set(re.findall(r"(--[a-z0-9-]+)(?: [^;(]*)? \(", line))
    assert named == NOT_MODELLED_LLAMA, line
    kept, skip = [], False
    for word in argv:  # the same line without the refused flags (and their values)
        skip = word in NOT_MODELLED_LLAMA or (skip and not word.startswith("--"))
        if not skip:
            kept.append(word)
    done, out = run(command, kept, 8, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["kernels"]["attention_backend"] == "fused"
    assert data["kernels"]["cross_entropy_loss_fusion"] is True
    assert data["plan"]["distributed_optimizer"] is True
    assert any("--sequence-parallel is off at TP 1" in n for n in data["notes"])
    assert "--grad-reduce-in-bf16" in data["megatron_args"]  # modelled (issue 26), kept
