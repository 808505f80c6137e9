"""The rules a resume is checked against before any state loads (capture_megatron.train.resume,
capture_megatron.megatron.schedule): the padded vocabulary and Megatron-LM's schedule rule. The
end-to-end runs are in tests/dist/test_resume_rules.py."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import (
    BuildOptions,
    DataOptions,
    ModelShape,
    OptimOptions,
    ParallelPlan,
    RunOptions,
    TrainConfig,
)
from capture_megatron.config.training import CheckpointOptions
from capture_megatron.errors import CaptureError
from capture_megatron.flags import parser as flags
from capture_megatron.megatron.schedule import check_resume, schedule
from capture_megatron.train import resume
from capture_megatron.train.entry import build_parser
from capture_megatron.train.resume import SavedRun, check_vocab, divisor_for

SHAPE = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=257
)


def _saved(shape: ModelShape, tp: int) -> SavedRun:
    plan = ParallelPlan(
        tp=tp, pp=1, dp=1, micro_batch_size=1, global_batch_size=4, layers_per_stage=(2,)
    )
    common = {"shape": shape.to_json(), "plan": plan.to_json()}  # as written before 'vocab_size'
    return SavedRun.from_common("ckpt/iter_0000003", common)


@pytest.mark.parametrize(
    "vocab, padded, tp, multiple, divisor",
    [
        (257, 384, 2, 128, 64),  # the saved 128 x 1 kept: 64 x 2
        (257, 512, 1, 256, 256),
        (257, 384, 3, 128, 64),  # 3 does not divide 128: the smallest, 64 x 3 = 192
        (257, 384, 5, 128, None),
        (50257, 50304, 2, 128, 64),
        (50257, 50304, 3, 128, 16),
        (300, 257, 1, 128, None),
    ],
)
def test_the_divisor_that_pads_alike(vocab, padded, tp, multiple, divisor):
    assert divisor_for(vocab, padded, tp, multiple) == divisor
    if divisor is not None:
        assert (
            SHAPE.replace(vocab_size=vocab, make_vocab_size_divisible_by=divisor).padded_vocab(tp)
            == padded
        )


def test_another_tp_with_the_same_padded_vocabulary_loads():
    saved = _saved(SHAPE, 2)  # 257 -> 512 at 128 x 2
    assert saved.padded_vocab_size == 512
    check_vocab(saved, SHAPE.replace(make_vocab_size_divisible_by=256), tp=1)
    check_vocab(saved, SHAPE, tp=4)  # 128 x 4 = 512 too


def test_another_padded_vocabulary_is_refused_with_the_fix():
    with pytest.raises(CaptureError) as err:
        check_vocab(_saved(SHAPE, 1), SHAPE, tp=2)
    text = str(err.value)
    assert "257 tokens to 384 rows (--make-vocab-size-divisible-by 128 x TP 1)" in text
    assert "pad it to 512 rows (--make-vocab-size-divisible-by 128 x TP 2)" in text
    assert "Give --make-vocab-size-divisible-by 64 to pad it to 384 rows at TP 2" in text
    with pytest.raises(CaptureError, match="384 is not a multiple of 5"):
        check_vocab(_saved(SHAPE, 1), SHAPE, tp=5)


def test_another_tokenizer_is_refused():
    with pytest.raises(CaptureError, match="vocabulary of 257 tokens and this run's has 50257"):
        check_vocab(_saved(SHAPE, 1), SHAPE.replace(vocab_size=50257), tp=1)


def _check(saved_optim: OptimOptions, optim: OptimOptions, train_iters=(6, 6), **flags) -> None:
    saved = dataclasses.asdict(schedule(saved_optim, train_iters[0], 16))
    current = schedule(optim, train_iters[1], 16)
    check_resume(
        {**saved, "num_steps": 6 * 16}, 16, current, 16, CheckpointOptions(**flags), "ck", 6
    )


def test_the_same_schedule_resumes_without_a_flag():
    _check(OptimOptions(), OptimOptions())
    _check(OptimOptions(lr_decay_iters=6), OptimOptions(lr_decay_iters=6), train_iters=(6, 20))


def test_a_changed_schedule_names_every_difference_and_both_flags():
    with pytest.raises(CaptureError) as err:
        _check(OptimOptions(), OptimOptions(lr=3e-4, lr_warmup_iters=2), train_iters=(6, 10))
    text = str(err.value)
    for part in (
        "peak learning rate (--lr) 0.0001 in the checkpoint, 0.0003 here",
        "warm-up (--lr-warmup-iters) 0 iterations (0 samples) in the checkpoint, "
        "2 iterations (32 samples) here",
        "decay horizon (--lr-decay-iters, default --train-iters) 6 iterations (96 samples) in "
        "the checkpoint, 10 iterations (160 samples) here",
        "--override-opt_param-scheduler to follow this run's flags from iteration 7 on",
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule (the "
        "checkpoint's schedule has already decayed",
    ):
        assert part in text
    assert "weight-decay horizon" not in text  # it follows the decay horizon: named once
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        _check(OptimOptions(), OptimOptions(lr=3e-4), **{flag: True})


def test_the_schedule_flags_parse_in_both_spellings_and_exclude_each_other():
    base = [
        "--num-layers",
        "2",
        "--hidden-size",
        "8",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "4",
        "--mock-data",
    ]
    for argv, field in (
        (["--override-opt_param-scheduler"], "override_opt_param_scheduler"),
        (["--override-opt-param-scheduler"], "override_opt_param_scheduler"),
        (["--use-checkpoint-opt_param-scheduler"], "use_checkpoint_opt_param_scheduler"),
        (["--use-checkpoint-opt-param-scheduler"], "use_checkpoint_opt_param_scheduler"),
    ):
        opts = flags.from_namespace(
            CheckpointOptions, flags.parse_flags(build_parser(), [*base, *argv])
        )
        assert getattr(opts, field) is True
    with pytest.raises(CaptureError, match="contradict: give one"):
        CheckpointOptions(
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True
        )


def test_a_resume_checks_the_optimizer_only_when_it_loads_it():
    plan = ParallelPlan(
        tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=4, layers_per_stage=(2,)
    )
    saved = dataclasses.asdict(schedule(OptimOptions(), 6, 4))
    common = {
        "shape": SHAPE.to_json(),
        "plan": plan.to_json(),
        "opt_param_scheduler": {**saved, "num_steps": 24},
        "iteration": 6,
    }

    def check(**checkpoint) -> None:
        cfg = TrainConfig(
            shape=SHAPE,
            plan=dataclasses.replace(plan, distributed_optimizer=True),
            optim=OptimOptions(lr=3e-4),
            data=DataOptions(mock_data=True),
            checkpoint=CheckpointOptions(load="ckpt", **checkpoint),
            run=RunOptions(train_iters=6),
            build=BuildOptions(),
        )
        current = schedule(cfg.optim, cfg.run.train_iters, 4)
        resume.check_resume(SavedRun.from_common("ck", common), common, cfg, current)

    with pytest.raises(CaptureError, match="saved without --use-distributed-optimizer"):
        check()
    check(no_load_optim=True)  # weights only: neither the optimizer layout nor the schedule
    check(finetune=True)
