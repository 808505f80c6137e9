"""`capture-megatron train --nproc N <Megatron flags>`: validate the flags for a job of N processes,
then train under torchrun (`torchrun -m capture_megatron.pretrain_gpt`). On failure, names the last
complete checkpoint to resume from."""

from __future__ import annotations

import argparse
import sys

from capture_megatron.flags.parser import summary
from capture_megatron.train.launch import failure_message, run_torchrun

NPROC_HELP = "processes on this node (torchrun) (default: 1)"
"""--nproc's help text."""
USAGE = "%(prog)s [--nproc N] <pretrain_gpt.py flags: model, parallelism, data, training>"
"""The train command's one-line usage (argparse's lists every one of its hundreds of flags)."""
EXAMPLE = (
    "--nproc 4 --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --vocab-size 1024 --micro-batch-size 1 --global-batch-size 8 "
    "--pipeline-model-parallel-size 2 --mock-data --train-iters 10"
)
"""The command line --help opens with (after the program name)."""
ESSENTIAL = (
    "--nproc",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--micro-batch-size",
    "--global-batch-size",
    "--data-path",
    "--mock-data",
    "--train-iters",
    "--save",
    "--load",
    "--memory-report",
)
"""The flags --help lists first."""


def main(argv: list[str]) -> int:
    """Entry point: --nproc N plus pretrain_gpt's Megatron flags."""
    parser = argparse.ArgumentParser(prog="capture-megatron train", add_help=False)
    parser.add_argument("--nproc", type=int, default=1, help=NPROC_HELP)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--help-all", action="store_true")
    ns, rest = parser.parse_known_args(argv)
    if ns.help or ns.help_all:
        from capture_megatron.train.entry import build_parser

        full = build_parser("capture-megatron train", summary(__doc__))
        full.add_argument_group("launch").add_argument(
            "--nproc", type=int, default=1, help=NPROC_HELP
        )
        full.usage, full.example, full.essential = USAGE, EXAMPLE, ESSENTIAL
        full.show_all = ns.help_all
        full.print_help()
        return 0
    rc = run_torchrun(ns.nproc, rest)
    if rc != 0:
        print(failure_message(rc, rest), file=sys.stderr)
    return 128 - rc if rc < 0 else rc  # torchrun killed by a signal: the shell's convention
