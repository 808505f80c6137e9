"""Every subcommand's --help: its own description (the whole first paragraph of its module's
docstring, never another command's or a sentence cut short) and a usage line naming each flag
once."""

from __future__ import annotations

import importlib
import re

import pytest

from capture_megatron import cli
from capture_megatron.megatron.flags import summary


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
