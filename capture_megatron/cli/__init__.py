"""`capture-megatron`: one console script, one subcommand per stage of the data flow.

This package only parses arguments and prints; the work is done by the typed API of the stage
packages (profile, fit, predict, plan, train). Nothing outside cli/ imports it. Every subcommand's
user errors (CaptureError) are printed as one paragraph on stderr with exit code 2; nothing a user
types produces a traceback.
"""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType
from typing import NoReturn

from capture_megatron.errors import CaptureError, Stopped
from capture_megatron.megatron import quiet

COMMANDS = {
    "demo": (
        "capture_megatron.cli.demo",
        "plan a small GPT for 4 CPU ranks, train it, compare with uniform",
    ),
    "preprocess": (
        "capture_megatron.cli.preprocess",
        "text / JSONL -> Megatron indexed dataset (.bin/.idx)",
    ),
    "profile": (
        "capture_megatron.cli.profile",
        "measure Megatron-Core pieces' memory -> records.jsonl",
    ),
    "fit": (
        "capture_megatron.cli.fit",
        "fit per-component memory regressions -> memory_model.json",
    ),
    "predict": (
        "capture_megatron.cli.predict",
        "per-rank peak memory of the run a Megatron-LM command line describes",
    ),
    "plan": (
        "capture_megatron.cli.plan",
        "memory-balanced layout and TP/PP/DP choice for a cluster",
    ),
    "train": ("capture_megatron.cli.train", "validate Megatron flags and launch torchrun training"),
    "verify": (
        "capture_megatron.cli.verify",
        "plan, train a few iterations, compare measured with predicted",
    ),
    "launch": ("capture_megatron.cli.launch", "render a Slurm batch script for a plan"),
    "megatron-lm": (
        "capture_megatron.cli.megatron_lm",
        "plan, then run your Megatron-LM checkout's pretrain_gpt",
    ),
}
"""Subcommand -> (module, one-line help); each module has main(argv: list[str]) -> int."""


def usage() -> str:
    """The top-level help text."""
    lines = ["usage: capture-megatron [--version] <command> [Megatron flags ...]", "", "commands:"]
    lines += [f"  {name:11s} {text}" for name, (_, text) in COMMANDS.items()]
    lines += [
        "",
        "`capture-megatron <command> --help`: an example and the essential flags; --help-all: "
        "every flag, Megatron-LM's included.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from capture_megatron.cli.version import text

        print(text())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"capture-megatron: error: unknown command {name!r}; "
            f"choose one of {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    quiet.install()  # megatron-core's warnings that do not concern the user, before it is imported
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return int(module.main(rest) or 0)
    except CaptureError as err:
        print(f"capture-megatron {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"capture-megatron {name}: interrupted", file=sys.stderr)
        return 130
    except Stopped as stop:
        print(
            f"capture-megatron {name}: stopped by {signal.Signals(stop.signum).name}",
            file=sys.stderr,
        )
        return 128 + stop.signum


def run() -> NoReturn:
    """The console script: main(), then exit without the teardown of what the command imported
    (torch, megatron-core: about 1 s of CPU; capture_megatron.megatron.lifeline.exit_now)."""
    from capture_megatron.megatron.lifeline import exit_now

    exit_now(main())


def _stop(signum: int, frame: FrameType | None) -> None:
    """SIGTERM / SIGHUP: unwind (temporary directories, worker processes), then exit."""
    raise Stopped(signum)
