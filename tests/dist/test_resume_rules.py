"""What a resume may change (capture_megatron.train.resume): a TP that pads the vocabulary to
another size, and a learning-rate schedule that differs from the checkpoint's.

One tiny TP1 run saves the checkpoints every test resumes from. Runs of one process use
pretrain_gpt's launcher-less mode (a gloo group of one); the TP2 resume runs under real torchrun.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from harness import Run, cli, losses, train, train_single

from capture_megatron.train.checkpoint.save_load import TRACKER, iteration_dir

# 257 tokens (ByteTokenizer's vocabulary): --make-vocab-size-divisible-by 128 pads them to 384
# rows at TP1 and to 512 at TP2
TINY = [
    *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"),
    *("--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "257"),
    *("--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data"),
    *("--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--seed", "7"),
    "--no-progress",
]
LR = 1e-3


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[float]]:
    """Three TP1 iterations (linear decay to 0 over them), checkpoints at iterations 2 and 3."""
    work = tmp_path_factory.mktemp("resume-rules")
    ckpt = work / "ckpt"
    run = train_single(
        [*TINY, "--train-iters", "3", "--save", str(ckpt), "--save-interval", "2"],
        str(work),
        "tp1",
    )
    return ckpt, losses(run)


def _lrs(run: Run) -> list[tuple[int, float]]:
    """(iteration, learning rate) of each iteration of a successful run."""
    losses(run)
    assert run.report is not None
    return [(it.iteration, it.lr) for it in run.report.iterations]


def test_resume_under_a_tp_that_pads_the_vocabulary_otherwise(saved, tmp_path):
    ckpt, tp1 = saved
    at2 = tmp_path / "at2"  # resume from iteration 2, whose next loss TP1 measured
    shutil.copytree(iteration_dir(str(ckpt), 2), iteration_dir(str(at2), 2))
    (at2 / TRACKER).write_text("2")
    common = torch.load(Path(iteration_dir(str(at2), 2), "common.pt"))
    assert (common["vocab_size"], common["padded_vocab_size"]) == (257, 384)
    args = [*TINY, "--train-iters", "3", "--tensor-model-parallel-size", "2", "--load", str(at2)]
    refused = cli(["train", "--nproc", "2", *args])
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr
    assert "pads its vocabulary of 257 tokens to 384 rows" in refused.stderr
    assert "pad it to 512 rows" in refused.stderr
    assert "Give --make-vocab-size-divisible-by 64" in refused.stderr
    # the loss of the first resumed iteration is computed before its update (no dropout), so it
    # is the loaded model's: padded alike, TP2 computes TP1's function
    fixed = train(2, [*args, "--make-vocab-size-divisible-by", "64"], str(tmp_path), "tp2")
    assert losses(fixed) == pytest.approx(tp1[2:], rel=1e-5)


def test_a_longer_run_needs_a_schedule_flag(saved, tmp_path):
    ckpt, _ = saved
    args = [*TINY, "--train-iters", "4", "--load", str(ckpt)]
    refused = train_single(args, str(tmp_path), "refused")
    assert refused.returncode == 2 and refused.report is None, refused.output[-3000:]
    assert "Traceback" not in refused.output
    for text in (
        "decay horizon (--lr-decay-iters, default --train-iters) 3 iterations (6 samples) in the "
        "checkpoint, 4 iterations (8 samples) here",
        "--override-opt_param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
    ):
        assert text in refused.output
    ours = train_single([*args, "--override-opt_param-scheduler"], str(tmp_path), "override")
    # this run's linear decay over 4 iterations, 3 done: a quarter of the peak
    assert _lrs(ours) == [(4, pytest.approx(LR / 4))]
    kept = train_single([*args, "--use-checkpoint-opt-param-scheduler"], str(tmp_path), "kept")
    # the checkpoint's decay over 3 iterations is over: --min-lr (0)
    assert _lrs(kept) == [(4, 0.0)]


@pytest.mark.parametrize(
    "changes, named",
    [
        # shape-keeping: stock Megatron-LM refuses each; here they loaded and trained on
        (
            [
                *("--num-attention-heads", "4", "--normalization", "RMSNorm"),
                *("--disable-bias-linear", "--position-embedding-type", "rope"),
            ],
            [
                "--num-attention-heads 2 in the checkpoint, 4 here",
                "--normalization LayerNorm in the checkpoint, RMSNorm here",
                "--disable-bias-linear not given in the checkpoint, given here",
                "--position-embedding-type learned_absolute in the checkpoint, rope here",
            ],
        ),
        # shape-changing: these failed after launch with tracebacks
        (
            [
                *("--num-layers", "2", "--hidden-size", "32", "--swiglu"),
                *("--untie-embeddings-and-output-weights", "--max-position-embeddings", "16"),
            ],
            [
                "--num-layers 1 in the checkpoint, 2 here",
                "--hidden-size 16 in the checkpoint, 32 here",
                "--swiglu not given in the checkpoint, given here",
                "--untie-embeddings-and-output-weights not given in the checkpoint, given here",
                "--max-position-embeddings 8 in the checkpoint, 16 here",
            ],
        ),
    ],
)
def test_architecture_changes_are_refused_before_launch(saved, tmp_path, changes, named):
    ckpt, _ = saved
    args = [*TINY, "--train-iters", "3", "--load", str(ckpt), *changes]
    refused = cli(["train", "--nproc", "1", *args])
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr and not refused.stdout.strip(), refused.stdout
    assert f"--load {ckpt}/iter_0000003: this run's model differs" in refused.stderr
    for text in named:
        assert text in refused.stderr
