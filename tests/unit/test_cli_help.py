"""Every subcommand's --help: its own description (the whole first paragraph of its module's
docstring, never another command's or a sentence cut short), a usage line naming each flag
once, then one example command line that parses, the essential options, and Megatron-LM's long
tail of flags counted (listed by --help-all)."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex

import pytest

from capture_megatron import cli
from capture_megatron.flags import parser as flags
from capture_megatron.flags.parser import summary


def _help(name: str, capsys) -> str:
    try:
        rc = cli.main([name, "--help"])
    except SystemExit as done:  # argparse's --help
        rc = done.code
    assert rc in (0, None)
    return capsys.readouterr().out


def _description(text: str) -> str:
    """The paragraph between the usage block and the first option group, without whitespace
    (argparse re-wraps it, also after hyphens)."""
    return "".join(text.split("\n\n")[1].split())


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_shows_the_commands_own_description(name, capsys):
    text = _help(name, capsys)
    own = summary(importlib.import_module(cli.COMMANDS[name][0]).__doc__)
    assert text.startswith(f"usage: capture-megatron {name} [")
    assert _description(text) == "".join(own.split()) and own.endswith("."), text[:3000]
    assert re.search(rf"`capture-megatron {name}\b", own), own


def test_train_usage_names_nproc_once(capsys):
    text = _help("train", capsys)
    usage = text.split("\n\n")[0]
    assert usage.count("--nproc") == 1 and text.count("usage:") == 1
    assert "--nproc NPROC         processes on this node (torchrun) (default: 1)" in text


def _example(text: str, name: str) -> list[str]:
    """The argv of the example a help text opens with (its wrapped lines joined again)."""
    block = text.split("\nexample:\n", 1)[1].split("\n\n", 1)[0]
    words = shlex.split(block.replace(" \\\n", " "))
    assert words[:2] == ["capture-megatron", name], block
    return words[2:]


PARSED = {
    "plan": "capture_megatron.cli.plan",
    "predict": "capture_megatron.cli.predict",
    "profile": "capture_megatron.cli.profile",
    "verify": "capture_megatron.cli.verify",
    "launch": "capture_megatron.cli.launch",
}
"""Subcommands whose module exposes build_parser (the parser main() parses with)."""


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_opens_with_an_example(name, capsys):
    text = _help(name, capsys)
    head = text.split("\n\n")
    assert head[2].startswith("example:\n  capture-megatron " + name), text[:2000]
    argv = _example(text, name)
    if name in PARSED:  # the example parses, flag by flag, without running the command
        parser = importlib.import_module(PARSED[name]).build_parser()
        ns = flags.parse_flags(parser, argv)
        assert ns.device in ("", "cpu")
    elif name == "train":
        from capture_megatron.train.entry import build_parser

        assert argv[:2] == ["--nproc", "4"]
        ns = flags.parse_flags(build_parser(), argv[2:])
        assert ns.pipeline_model_parallel_size == 2 and ns.mock_data


def test_plan_help_is_short_and_starts_with_what_a_user_needs(capsys):
    text = _help("plan", capsys)
    lines = text.splitlines()
    assert len(lines) < 120, len(lines)
    first = "\n".join(lines[:40])
    for needed in ("--gpus", "--gpu-memory-gib", "--hf-config", "--preset", "--global-batch-size"):
        assert f"\n  {needed} " in first, needed
    assert "--recompute-granularity" not in text and "--ffn-hidden-size" not in text
    parser = importlib.import_module(PARSED["plan"]).build_parser()
    count = parser.hidden_count()
    assert count > 100 and f"\n{count} more Megatron-LM flags: --help-all\n" in text


@pytest.mark.parametrize("name", ["plan", "predict", "verify"])
def test_help_all_lists_every_generated_flag(name, capsys):
    try:
        cli.main([name, "--help-all"])
    except SystemExit as done:
        assert done.code in (0, None)
    text = capsys.readouterr().out
    parser = importlib.import_module(PARSED[name]).build_parser()
    shown = [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS
    ]
    assert "--recompute-granularity" in shown and "--ffn-hidden-size" in shown
    missing = [flag for flag in shown if f"  {flag}" not in text]
    assert not missing and "more Megatron-LM flags" not in text, missing


def test_train_help_all_is_not_passed_to_torchrun(capsys):
    assert cli.main(["train", "--help-all"]) == 0
    text = capsys.readouterr().out
    assert "--recompute-granularity" in text and "--nproc NPROC" in text
