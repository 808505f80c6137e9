"""The nonsense values issue 29 (items 6 and 8) found used, or crashing, or running for minutes:
each is refused at once now, one paragraph naming the flag or field. In-process, on a synthetic
memory model (no profiling); tests/unit/test_numeric_flags_fuzz.py fuzzes every numeric flag."""

from __future__ import annotations

import json
import time

import pytest
from synthetic_memory import full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.cli import predict as predict_cli
from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.fit import write_model
from capture_megatron.planner import read_plan

SHAPE = ModelShape(
    num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=64, vocab_size=512
)
BASE = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "512"),
    *("--global-batch-size", "8", "--gpus", "4", "--gpu-memory-gib", "80", "--no-progress"),
]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("nonsense") / "memory_model.json"
    write_model(full_model(SHAPE), str(path))
    return str(path)


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--context-gib", "-1000", "must be at least 0"),
        ("--reserve-fraction", "-1", "must be at least 0"),
        ("--reserve-fraction", "1", "must be below 1"),
        ("--ffn-hidden-size", "-1", "must be at least 0"),
        ("--norm-epsilon", "nan", "must be a finite number"),
        ("--micro-batch-size", "0", "must be at least 1"),  # it became 1
        ("--make-vocab-size-divisible-by", "0", "must be at least 1"),  # ZeroDivisionError
        ("--top", "0", "must be at least 1"),
        ("--top", "-1", "must be at least 1"),
        ("--gpu-memory-gib", "inf", "must be positive and finite"),
        ("--gpu-memory-gib", "nan", "must be positive and finite"),
        ("--gpu-memory-gib", "1e308", "must be positive and finite"),
        ("--lr", "nan", "must be a finite number"),
        ("--gpus", "1000000000", "at most 1,048,576 GPUs are planned for"),  # ran for minutes
        ("--num-layers", "100000", "at most 512 layers are planned"),
        ("--global-batch-size", "100000000", "at most 65,536 are simulated"),
    ],
)
@pytest.mark.parametrize("command", [plan_cli, predict_cli])
def test_refused_at_once(model_file, command, flag, value, words):
    if command is predict_cli and flag == "--top":
        pytest.skip("--top is plan's")
    start = time.monotonic()
    with pytest.raises(CaptureError) as err:
        command.main([*BASE, "--memory-model", model_file, flag, value])
    if not (command is predict_cli and flag == "--gpus"):  # predict: DP 1e9 does not divide
        assert flag in str(err.value) and words in str(err.value), str(err.value)
    assert time.monotonic() - start < 30


def test_mfu_nonsense(model_file):
    """--mfu (now an alias of --gemm-efficiency, a fraction of peak in (0, 1])."""
    for value in ("nan", "-1", "0", "2"):
        with pytest.raises(CaptureError, match="--gemm-efficiency|--mfu"):
            plan_cli.main([*BASE, "--memory-model", model_file, "--mfu", value])


@pytest.mark.parametrize("flag", ["--hidden-size", "--vocab-size"])
def test_sizes_of_1e30_are_refused(model_file, flag):
    """hidden or vocabulary 10**30 (an integer: a config.json can hold one) was planned."""
    with pytest.raises(CaptureError, match=f"{flag} {10**30}: at most [0-9,]+ is planned"):
        plan_cli.main([*BASE, "--memory-model", model_file, flag, str(10**30)])
    with pytest.raises(CaptureError, match="must be an integer"):
        ModelShape(
            num_layers=2, hidden_size=1e30, num_attention_heads=4, seq_length=8, vocab_size=64
        )


def test_plan_file_sizes_must_be_integers(tmp_path, model_file):
    out = tmp_path / "plan.json"
    assert plan_cli.main([*BASE, "--memory-model", model_file, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    tp = data["plan"]["tp"]
    data["plan"]["tp"] = float(tp)  # e.g. 2.0 was taken as TP
    out.write_text(json.dumps(data))
    with pytest.raises(CaptureError, match=f"tp {float(tp)} must be an integer"):
        read_plan(str(out))
    with pytest.raises(CaptureError, match="must be an integer"):
        ParallelPlan(
            tp=2.0, pp=1, dp=1, micro_batch_size=1, global_batch_size=2, layers_per_stage=(4,)
        )


def test_a_nested_float_is_refused_after_its_equal_int_was_taken(tmp_path, model_file):
    """Nested settings are checked once per object (fields._nested_problems): a plan file's
    wgrad_deferral_limit 0.0 equals the 0 of a plan read before it, and is still refused."""
    out = tmp_path / "plan.json"
    assert plan_cli.main([*BASE, "--memory-model", model_file, "--json", str(out)]) == 0
    read_plan(str(out))
    data = json.loads(out.read_text())
    data["plan"]["ddp"]["wgrad_deferral_limit"] = 0.0
    out.write_text(json.dumps(data))
    with pytest.raises(CaptureError, match="--wgrad-deferral-limit 0.0 must be an integer"):
        read_plan(str(out))


@pytest.mark.parametrize("fmt", ["torch", "fsdp_dtensor"])
def test_checkpoint_formats_are_predicted_and_refused_for_training(model_file, tmp_path, fmt):
    """--ckpt-format does not change training memory: predict takes Megatron-LM's functional
    tests that save torch / fsdp_dtensor checkpoints; only training, which saves torch_dist,
    refuses them (one paragraph naming the flag)."""
    from capture_megatron.config.training import CheckpointOptions

    out = tmp_path / "p.json"
    argv = [*BASE, "--memory-model", model_file, "--ckpt-format", fmt, "--json", str(out)]
    assert predict_cli.main([*argv, "--tensor-model-parallel-size", "1"]) == 0
    assert json.loads(out.read_text())["fits"] is True
    with pytest.raises(CaptureError, match=f"--ckpt-format {fmt}: .*train with --ckpt-format"):
        CheckpointOptions(ckpt_format=fmt).require_trainable()
    CheckpointOptions().require_trainable()  # torch_dist
