"""Every numeric flag of `plan` and `predict`, given nonsense (issue 29, items 6 and 8): each run
ends with exit 0 or one paragraph (exit 2, a CaptureError), never a traceback, and within 30 s.

The flags are read from the commands' parsers, which are generated from the option dataclasses'
flag fields (megatron.flags.add_fields) plus the cluster flags: a flag added to any option class
is fuzzed without touching this file. Megatron-LM's other flags, which both commands accept and
ignore (they cannot change memory), are left out. Runs in-process on a synthetic memory model of
a small model (no profiling)."""

from __future__ import annotations

import contextlib
import io
import signal

import pytest
from synthetic_memory import full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.cli import predict as predict_cli
from capture_megatron.config import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.fit import write_model
from capture_megatron.flags.megatron_lm import PREFIX

SHAPE = ModelShape(
    num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=64, vocab_size=512
)
BASE = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "512"),
    *("--global-batch-size", "8", "--gpus", "4", "--gpu-memory-gib", "80", "--no-progress"),
]
VALUES = {
    int: ("0", "-1", "1000000000"),
    float: ("0", "-1", "nan", "inf", "1e308"),
}
"""Nonsense per flag type (argparse itself refuses 'nan' or '2.5' for an integer flag)."""
LIMIT = 30
"""Seconds one run may take."""
COMMANDS = {"plan": plan_cli, "predict": predict_cli}


def numeric_flags(command: str) -> list[tuple[str, type]]:
    """(flag, type) of every numeric flag the command reads (not Megatron-LM's ignored ones)."""
    parser = COMMANDS[command].build_parser()
    return sorted(
        {
            (a.option_strings[0], a.type)
            for a in parser._actions
            if a.option_strings
            and a.type in VALUES
            and a.nargs is None
            and not a.dest.startswith(PREFIX)
        },
        key=lambda f: f[0],
    )


CASES = [(c, flag, kind) for c in COMMANDS for flag, kind in numeric_flags(c)]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fuzz") / "memory_model.json"
    write_model(full_model(SHAPE), str(path))
    return str(path)


class _TooSlow(BaseException):
    """Raised by the alarm after LIMIT seconds."""


def _alarm(signum, frame):
    raise _TooSlow()


def test_every_declared_flag_is_fuzzed():
    names = {flag for _, flag, _ in CASES}
    for flag in ("--hidden-size", "--global-batch-size", "--micro-batch-size", "--gpus"):
        assert flag in names
    assert {"--context-gib", "--reserve-fraction", "--gpu-memory-gib", "--top"} <= names
    assert len(CASES) > 60


@pytest.mark.slow  # ~130 cases, a few plans each: about 25 s of CPU
@pytest.mark.parametrize("command, flag, kind", CASES, ids=[f"{c}{f}" for c, f, _ in CASES])
def test_nonsense_is_exit_0_or_one_paragraph(model_file, tmp_path, command, flag, kind):
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for value in VALUES[kind]:
            argv = [*BASE, "--memory-model", model_file, flag, value]
            signal.alarm(LIMIT)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    COMMANDS[command].main(argv)
            except CaptureError as err:
                assert "\n" not in str(err).strip(), (value, str(err))
            except _TooSlow:
                pytest.fail(f"{command} {flag} {value}: still running after {LIMIT} s")
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)
