"""`capture-megatron`: one console script, one subcommand per stage of the data flow.

Every subcommand's user errors (CaptureError) are printed as one paragraph on stderr with exit code 2;
nothing a user types produces a traceback.
"""
from __future__ import annotations

import importlib
import sys

from capture_megatron.errors import CaptureError

# subcommand -> (module, one-line help); each module has main(argv: list[str]) -> int
COMMANDS = {
    "demo": ("capture_megatron.demo", "plan a small GPT for 4 CPU ranks, train it, compare with uniform"),
    "preprocess": ("capture_megatron.data.preprocess", "text / JSONL -> Megatron indexed dataset (.bin/.idx)"),
    "profile": ("capture_megatron.profile.cli", "measure Megatron-Core pieces' memory -> records.jsonl"),
    "fit": ("capture_megatron.fit_cli", "fit per-component memory regressions -> memory_model.json"),
    "plan": ("capture_megatron.plan_cli", "memory-balanced layout and TP/PP/DP choice for a cluster"),
    "train": ("capture_megatron.launcher", "plan (or take the given plan) and launch torchrun training"),
    "verify": ("capture_megatron.verify", "train a few iterations and compare measured with predicted memory"),
    "launch": ("capture_megatron.slurm", "render a Slurm batch script for a plan"),
    "megatron-lm": ("capture_megatron.megatron_lm", "plan, then run your Megatron-LM checkout's pretrain_gpt"),
}


def usage() -> str:
    """The top-level help text."""
    lines = ["usage: capture-megatron <command> [Megatron flags ...]", "", "commands:"]
    lines += [f"  {name:11s} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`capture-megatron <command> --help` lists a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"capture-megatron: error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return int(module.main(rest) or 0)
    except CaptureError as err:
        print(f"capture-megatron {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"capture-megatron {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
