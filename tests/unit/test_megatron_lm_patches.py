"""patches/ for users' own Megatron-LM: the per-stage recompute patch applies cleanly to
the installed megatron-core sources (in a temporary copy) and the patched TransformerBlock
recomputes each stage's own count; the Megatron-LM wrapper plans and builds the right command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import megatron.core
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCH = os.path.join(ROOT, "patches", "megatron_core_recompute_per_stage.patch")


@pytest.mark.slow
def test_recompute_per_stage_patch_applies_and_works(tmp_path):
    installed = os.path.dirname(
        os.path.dirname(megatron.core.__file__)
    )  # .../site-packages/megatron
    shutil.copytree(installed, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        ["git", "apply", "--check", "-p1", PATCH], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    subprocess.run(["git", "apply", "-p1", PATCH], cwd=tmp_path, check=True)
    assert (
        "recompute_num_layers_per_stage"
        in (tmp_path / "megatron/core/transformer/transformer_block.py").read_text()
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests/unit/patched_block_check.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line[:1].isdigit()]
    assert rows == [["0", "0"], ["1", "1"], ["2", "2"], ["3", "3"]], run.stdout
    assert "rejected: recompute_num_layers_per_stage needs" in run.stdout


def test_wrapper_gives_each_stage_its_recompute_count():
    import argparse

    from capture_megatron.megatron_lm import pretrain_gpt as wrapper

    parser = wrapper.add_capture_args(argparse.ArgumentParser())
    args = parser.parse_args(["--recompute-num-layers-per-stage", "3,0,1"])
    args.pipeline_model_parallel_size, args.recompute_num_layers = 3, 3
    args.recompute_granularity, args.recompute_method = "full", "block"
    assert [wrapper.stage_recompute(args, r).recompute_num_layers for r in range(3)] == [3, None, 1]
    assert wrapper.stage_recompute(args, 1).recompute_granularity is None
    assert args.recompute_num_layers == 3  # the shared args are not changed


@pytest.mark.slow
def test_megatron_lm_command_runs_the_balanced_plan(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text(
        "# stands for a Megatron-LM checkout; --dry-run only checks it exists\n"
    )
    user = [
        "--num-layers",
        "24",
        "--hidden-size",
        "512",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "512",
        "--max-position-embeddings",
        "512",
        "--vocab-size",
        "32000",
        "--bf16",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "4",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "64",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--data-path",
        "/data/x_text_document",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--lr",
        "1e-4",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CAPTURE_MEGATRON_CACHE=str(tmp_path / "cache"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "capture_megatron.cli",
            "megatron-lm",
            "--megatron-lm",
            str(tmp_path),
            "--nproc-per-node",
            "8",
            "--dry-run",
            "--plan-device",
            "fake",
            "--no-progress",
            "--objective",  # the memory-balanced split (throughput may find the even one fastest)
            "min-peak",
            *user,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith(
        f"MEGATRON_LM={tmp_path} CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 8"
    )
    args = line.split()
    for flag in ("--pipeline-model-parallel-size", "--recompute-method", "--recompute-num-layers"):
        assert args.count(flag) == 1, flag
    layout = args[args.index("--pipeline-model-parallel-layout") + 1].strip("'")
    # PP 4 as given, times the virtual stages the planner chose; the memory-balanced split
    # (min-peak), not Megatron's even one
    stages = layout.count("|") + 1
    assert stages in (4, 8) and layout.count("t") == 24, layout
    assert layout not in ("Etttttt|tttttt|tttttt|ttttttL", "Ettt|ttt|ttt|ttt|ttt|ttt|ttt|tttL")
    # The user's recompute (uniform, 1 layer per group) is kept as given, never re-planned.
    assert args[args.index("--recompute-method") + 1] == "uniform"
    assert args[args.index("--recompute-num-layers") + 1] == "1"
    assert "--recompute-num-layers-per-stage" not in args
    assert "--data-path" in args and "GPT2BPETokenizer" in args and "--no-progress" not in args
