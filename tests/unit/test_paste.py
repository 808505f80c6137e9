"""The pretrain_gpt.py flags of Megatron-LM's own launch scripts (tests/data/megatron_lm_examples,
paths replaced) given verbatim to `plan` and `predict` run, or are refused only for the flags that
change memory in a way not modelled, each one named: the Mixtral line (--vocab-size added: its
tokenizer file is not here) fits at NVIDIA's sizes, the Llama 3 8B FP8 line is forecast as given;
the DeepSeek-V3 line is predicted and planned where it fits."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from test_cli_errors import cli

EXAMPLES = Path(__file__).parents[1] / "data" / "megatron_lm_examples"


def flags_of(name: str) -> list[str]:
    """The example's flags, one per line as the script passes them."""
    lines = (EXAMPLES / f"{name}.args").read_text().splitlines()
    return [w for ln in lines if ln and not ln.startswith("#") for w in shlex.split(ln)]


pytestmark = pytest.mark.xdist_group("forecasts")  # sharing forecast_cache: tests/conftest.py


def run(command: str, argv: list[str], gpus: int, tmp_path: Path, cache: str):
    out = tmp_path / f"{command}.json"
    extra = ["--gpu-memory-gib", "80"] if command == "plan" else []
    argv = [command, *argv, "--gpus", str(gpus), *extra, "--no-progress", "--json", str(out)]
    return cli(argv, str(tmp_path), CAPTURE_MEGATRON_CACHE=cache), out


@pytest.mark.slow
@pytest.mark.parametrize("command", ["predict", "plan"])
def test_gpt3_175b_runs_verbatim(command, tmp_path, forecast_cache):
    done, out = run(command, flags_of("train_gpt3_175b_distributed"), 128, tmp_path, forecast_cache)
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
def test_llama3_8b_fp8_runs_verbatim(command, tmp_path, forecast_cache):
    """Megatron-LM's Llama 3 8B FP8 example (hybrid delayed scaling, amax history 1024, FP8
    parameters all-gathered, bf16 gradients) is forecast as given, its FP8 settings emitted."""
    done, out = run(command, flags_of("train_llama3_8b_h100_fp8"), 8, tmp_path, forecast_cache)
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


@pytest.mark.slow
@pytest.mark.parametrize("command", ["predict", "plan"])
def test_mixtral_runs_verbatim_at_nvidias_sizes(command, tmp_path, forecast_cache):
    # examples/mixtral: TP 1, PP 4, EP 8 need data parallelism 8, so 32 GPUs; its Llama 2
    # tokenizer file is not here, so --vocab-size 32000 (Mixtral's) is added
    argv = [*flags_of("train_mixtral_8x7b_distributed"), "--vocab-size", "32000"]
    done, out = run(command, argv, 32, tmp_path, forecast_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    args = data["megatron_args"]
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "4"
    assert args[args.index("--expert-model-parallel-size") + 1] == "8"
    # --no-position-embedding with RoPE changes nothing in megatron-core 0.16.1
    assert "--no-position-embedding" in data["ignored_flags"]
    if command == "predict":  # balanced routing, which its aux loss (1e-2) trains towards
        balanced = [*argv, "--moe-imbalance-factor", "1", "--gpu-memory-gib", "80"]
        done, out = run(command, balanced, 32, tmp_path, forecast_cache)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(out.read_text())["fits"] is True


SMALLEST = re.compile(r"the smallest fitting setup is (\d+) GPUs")
"""plan's answer when no plan of the given sizes fits the GPUs (exit 2): where one does."""


@pytest.mark.slow
def test_deepseek_v3_example_line_runs_verbatim(tmp_path, forecast_cache):
    """Megatron-LM's DeepSeek-V3 line (Megatron-FSDP flags aside; TP 1, EP 8, micro-batch 4 and
    selective recompute of mlp moe mla_up_proj layernorm fixed, HybridEP): predicted as written
    (PP 1), and planned: on 1024 GPUs of 80 GiB no plan of its sizes fits without offloading
    activations, and plan names the smallest cluster where one does, where it then plans (written
    for Megatron-FSDP, the line keeps a micro-batch of 4 on one pipeline; the plan pipelines it);
    with fine-grained activation offloading searched (the default) a plan fits on the 1024."""
    argv = [*flags_of("sbatch_mfsdp_deepseek_v3_no_fsdp"), "--vocab-size", "129280"]
    done, out = run("predict", argv, 256, tmp_path, forecast_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text())["plan"]["pp"] == 1
    kept = [*argv, "--no-activation-offload"]
    done, _ = run("plan", kept, 1024, tmp_path, forecast_cache)
    found = SMALLEST.search(done.stderr)
    assert done.returncode == 2 and found and len(done.stderr.splitlines()) == 1, done.stderr
    done, out = run("plan", kept, int(found.group(1)), tmp_path, forecast_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["fits"] is True and data["plan"]["tp"] == 1 and data["plan"]["ep"] == 8
    assert data["plan"]["micro_batch_size"] == 4
    assert "--fine-grained-activation-offloading" not in data["megatron_args"]
    done, out = run("plan", argv, 1024, tmp_path, forecast_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["fits"] is True and data["plan"]["micro_batch_size"] == 4
    assert "--fine-grained-activation-offloading" in data["megatron_args"]
    assert any("offloads the activations" in r for r in data["reasoning"])
