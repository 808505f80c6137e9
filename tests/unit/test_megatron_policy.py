"""Every flag of Megatron-LM's pretrain_gpt.py (core_v0.16.1) is known: declared by one of
capture-megatron's option classes, or ignored (it cannot change memory), or refused by name when it
changes memory in a way not modelled -- and `plan` / `predict` parse each of them."""

from __future__ import annotations

import pytest

from capture_megatron.cli.plan import build_parser as plan_parser
from capture_megatron.cli.predict import build_parser as predict_parser
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import flags, megatron_lm, policy

OURS = {name for name in predict_parser()._option_string_actions} - megatron_lm.flag_names()


def _declared_by_us() -> set[str]:
    p = flags.FlagParser()
    flags.add_model_flags(p)
    flags.add_kernel_flags(p)
    flags.add_parallel_flags(p)
    flags.add_training_flags(p)
    flags.add_fields(p, flags.DataOptions)
    flags.add_checkpoint_flags(p)
    return set(p._option_string_actions)


def test_every_megatron_flag_is_classified_once():
    ours = _declared_by_us()
    missing, twice = [], []
    for arg in megatron_lm.arguments():
        name = arg.flags[0]
        kinds = [
            bool(ours & set(arg.flags)),
            policy.ignored(*arg.flags),
            policy.unmodelled_reason(*arg.flags) is not None,
        ]
        if sum(kinds) == 0:
            missing.append(name)
        if kinds[1] and kinds[2] or (kinds[0] and (kinds[1] or kinds[2]) and name not in ours):
            twice.append(name)
    assert missing == [] and twice == []


def test_policy_names_only_megatron_flags():
    known = megatron_lm.flag_names()
    assert sorted(f for f in policy.IGNORED | set(policy.UNMODELLED) if f not in known) == []


@pytest.mark.parametrize("build", [plan_parser, predict_parser])
def test_every_megatron_flag_parses(build):
    parser = build()
    for arg in megatron_lm.arguments():
        assert set(arg.flags) <= set(parser._option_string_actions), arg.flags


def _check(argv: list[str]) -> tuple[str, ...]:
    base = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--gpus",
        "1",
    ]
    return megatron_lm.check(flags.parse_flags(predict_parser(), [*base, *argv]))


def test_ignored_and_refused_flags():
    assert _check(
        ["--eval-interval", "100", "--tensorboard-dir", "/tmp/tb", "--log-throughput"]
    ) == ("--eval-interval", "--log-throughput", "--tensorboard-dir")
    with pytest.raises(CaptureError) as err:
        _check(["--moe-use-upcycling", "--fp4-format", "e2m1", "--eval-iters", "3"])
    text = str(err.value)
    assert "--moe-use-upcycling (this mixture-of-experts option is not modelled yet)" in text
    assert "--fp4-format e2m1 (this low-precision (fp8 / fp4) option is not modelled yet)" in text
    assert "--eval-iters" not in text


def test_defaults_given_explicitly_are_accepted():
    assert _check(["--moe-upcycling-granularity", "1", "--softmax-type", "vanilla"]) == (
        "--moe-upcycling-granularity",
        "--softmax-type",
    )
    with pytest.raises(CaptureError, match="--moe-extended-tp"):
        _check(["--moe-extended-tp"])
    assert _check(["--moe-router-group-topk", "2"]) == ("--moe-router-group-topk",)


def test_a_typo_gets_the_closest_megatron_flag():
    with pytest.raises(
        CaptureError, match=r"--atention-backend \(did you mean --attention-backend\?\)"
    ):
        flags.parse_flags(predict_parser(), ["--atention-backend", "flash"])
