"""`capture-megatron predict <pretrain_gpt.py flags, verbatim> --gpus N [--gpu-memory-gib G]`: the
per-rank forecast of exactly the run those flags describe.

Megatron-LM's own split (or the layout / first-last / account-for-embedding-loss flags given), its
recompute, precision, transformer implementation and attention backend, with Megatron-LM's defaults
where a flag is absent. Every pretrain_gpt.py flag is accepted: those that cannot change memory are
ignored (and listed), those that change memory in a way not modelled are refused by name (exit 2).
Writes --json (the plan JSON's fields) and --png.
"""

from __future__ import annotations

from capture_megatron.api.args import predict_parser
from capture_megatron.api.request import cluster_of
from capture_megatron.cli.plan import plan_and_report
from capture_megatron.flags import parser as flags
from capture_megatron.flags.parser import summary

USAGE = (
    "%(prog)s [--hf-config CONFIG | --preset NAME] <pretrain_gpt.py flags, verbatim> --gpus N "
    "[--gpu-memory-gib G] [--device DEVICE] [--json FILE] [--png FILE]"
)
"""The predict command's one-line usage (argparse's lists every one of its hundreds of flags)."""
EXAMPLE = (
    "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 64 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --bf16 --gpus 8 "
    "--gpu-memory-gib 80"
)
"""The command line --help opens with (after the program name)."""
ESSENTIAL = (
    "--hf-config",
    "--preset",
    "--gpus",
    "--gpu-memory-gib",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--micro-batch-size",
    "--global-batch-size",
    "--device",
    "--json",
    "--png",
)
"""The flags --help lists first."""


def build_parser() -> flags.FlagParser:
    """A whole Megatron-LM command line, the cluster, and the memory margins."""
    return predict_parser(
        "capture-megatron predict",
        usage=USAGE,
        description=summary(__doc__),
        example=EXAMPLE,
        essential=ESSENTIAL,
    )


def main(argv: list[str]) -> int:
    """Entry point."""
    ns = flags.parse_flags(build_parser(), argv)
    cluster = cluster_of(ns, need_memory=False)
    plan_and_report(ns, cluster, ns.progress, fixed_plan=True)
    return 0
