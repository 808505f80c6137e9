"""Bad input on the command line: one paragraph naming the offending values, exit code 2, never a
traceback -- for the errors caught before any profiling or training process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from capture_megatron.version import __version__

MODEL = "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 512"
TINY = (
    MODEL + " --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
    "--hidden-dropout 0 --attention-dropout 0 --no-progress"
).split()


def cli(args: list[str], cwd: str, **env: str) -> subprocess.CompletedProcess:
    """Run the console script in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "capture_megatron.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=dict(os.environ, **env),
    )


def one_error(done: subprocess.CompletedProcess, command: str) -> str:
    """The single error line of a failed command (asserting exit 2 and no traceback)."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"capture-megatron {command}: error: "), lines
    return lines[0]


TRAIN_CASES = {
    "layout": (
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|tttL --mock-data",
        "places 5 transformer layers but --num-layers is 8",
    ),
    "heads_tp": (
        "--tensor-model-parallel-size 3 --mock-data",
        "heads 4 (query groups 4) not divisible by TP 3",
    ),
    "world": (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --mock-data",
        "world size 2 is not divisible by TP 2 x PP 2",
    ),
    "batch": (
        "--global-batch-size 15 --mock-data",
        "--global-batch-size 15 is not divisible by --micro-batch-size 2 x DP 2",
    ),
    "experts_ep": (
        "--num-experts 3 --expert-model-parallel-size 2 --disable-bias-linear --mock-data",
        "experts 3 not divisible by EP 2 (EP can be one of 1, 3)",
    ),
    "cp_seq": (
        "--context-parallel-size 2 --seq-length 30 --max-position-embeddings 30 --mock-data",
        "seq length 30 not divisible by 2 x CP 2",
    ),
    "data": ("--data-path /nonexistent/corpus_text_document", "/nonexistent/corpus_text_document"),
    "cp_comm_type": (
        "--context-parallel-size 2 --cp-comm-type p2p --mock-data",
        "p2p (ring), a2a (all-to-all) and a2a+p2p are Transformer Engine's algorithms",
    ),
    "no_data": ("", "no data: give --data-path PREFIX"),
    "flags": (
        "--mock-data --use-flash-attn --frobnicate",
        "Megatron-LM flags not supported by capture-megatron: --use-flash-attn; "
        "unknown arguments: --frobnicate",
    ),
}


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_train(name, tmp_path):
    extra, expected = TRAIN_CASES[name]
    done = cli(["train", "--nproc", "2", *TINY, *extra.split()], str(tmp_path))
    assert expected in one_error(done, "train")


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--device tpu", "--device 'tpu' is not one of cpu, fake-cpu, fake-cuda, cuda"),
        ("--device cuda", "no usable CUDA device"),
        ("--hidden-size 66", "hidden 66 not divisible by heads 4"),
    ],
)
def test_profile(argv, message, tmp_path):
    base = [*MODEL.split(), "--no-design", "--out", str(tmp_path / "x.jsonl")]
    assert message in one_error(cli(["profile", *base, *argv.split()], str(tmp_path)), "profile")


def test_plan_cluster_and_model_source(tmp_path):
    broken, partial = tmp_path / "broken.json", tmp_path / "partial.json"
    broken.write_text('{"hidden_size": 4096, "num_attention_heads": ')
    partial.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 4}))
    cases = [
        ("--preset gpt3-1.3b --gpus 0 --gpu-memory-gib 80", "--gpus 0 must be at least 1"),
        ("--preset gpt3-1.3b --gpus 8 --gpu-memory-gib -5", "--gpu-memory-gib -5 must be positive"),
        (f"--hf-config {broken} --gpus 8 --gpu-memory-gib 80", "is not valid JSON (line 1"),
        (
            f"--hf-config {partial} --gpus 8 --gpu-memory-gib 80",
            "lacks integer fields ['num_attention_heads', 'vocab_size']",
        ),
        (
            f"--hf-config {tmp_path / 'none.json'} --gpus 8 --gpu-memory-gib 80",
            "No such file or directory",
        ),
        ("--preset gpt3-9000b --gpus 8 --gpu-memory-gib 80", "gpt3-9000b"),
        ("--preset gpt3-1.3b --gpu-memory-gib 80", "--gpus is required"),
        ("--preset gpt3-1.3b --gpus 8 --gpu-memory-gib 80 --objective fastest", "invalid choice"),
    ]
    for args, expected in cases:
        assert expected in one_error(
            cli(["plan", *args.split(), "--no-progress"], str(tmp_path)), "plan"
        ), args


def _launch(plan_json: str, cwd: str) -> subprocess.CompletedProcess:
    args = [
        *TINY,
        "--mock-data",
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--cpu",
        "--plan-json",
        plan_json,
        "--sbatch",
        os.path.join(cwd, "job.sh"),
    ]
    return cli(["launch", *args], cwd)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{}", "is not a plan written by `capture-megatron plan --json`"),
        ("[1, 2]", "is not a plan written by `capture-megatron plan --json`"),
        ('{"plan": ', "is not valid JSON (line 1"),
        (
            json.dumps({"capture_megatron_plan": 1, "version": "0.0.1", "plan": {}}),
            f"was written by capture-megatron 0.0.1; this is {__version__}: plan again",
        ),
        (
            json.dumps({"capture_megatron_plan": 1, "version": __version__, "plan": {"tp": 1}}),
            "its plan is incomplete or invalid",
        ),
    ],
)
def test_launch_with_a_bad_plan_json(content, message, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(content)
    assert message in one_error(_launch(str(path), str(tmp_path)), "launch")
    assert not (tmp_path / "job.sh").exists()


def test_launch_with_a_missing_plan_json(tmp_path):
    line = one_error(_launch(str(tmp_path / "nowhere.json"), str(tmp_path)), "launch")
    assert "nowhere.json: No such file or directory" in line
