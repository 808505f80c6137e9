"""`capture-megatron plan <a Megatron-LM command line> --gpus N --gpu-memory-gib G`: the
TP/PP/DP/VPP/EP/CP sizes, micro-batch, recompute and pipeline layout for a cluster -- the fastest
plan that fits (default), the lowest peak (--objective min-peak) or the fewest GPUs (min-gpus).

Parallel sizes given on the command line are fixed (VPP in either of Megatron-LM's spellings), the
rest searched; with a split given (--pipeline-model-parallel-layout, the first/last stage layers,
--account-for-embedding/loss-in-pipeline-split) nothing is searched and the run is only
predicted. Every pretrain_gpt.py flag is accepted: those that cannot change memory are ignored (and
listed), those that change it in a way not modelled are refused by name.
"""

from __future__ import annotations

import argparse

from capture_megatron.api import Request, forecast, read_request
from capture_megatron.api.args import plan_parser
from capture_megatron.api.request import cluster_of
from capture_megatron.cli.compare import add_compare_flag, add_to_json, compare, print_comparison
from capture_megatron.cli.outputs import prepare_outputs
from capture_megatron.config import Cluster, ModelShape
from capture_megatron.config.hf_count import parameter_count
from capture_megatron.fit import MemoryModel, ModelSource
from capture_megatron.flags import parser as flags
from capture_megatron.planner import PlanResult, model_args

USAGE = (
    "%(prog)s [--hf-config CONFIG | --preset NAME | <Megatron-LM model flags>] --gpus N "
    "--gpu-memory-gib G [any other pretrain_gpt.py flag] [--objective throughput|min-peak|min-gpus]"
    " [--json FILE] [--png FILE]"
)
"""The plan command's one-line usage (argparse's lists every one of its hundreds of flags)."""
EXAMPLE = "--preset llama3-70b --gpus 64 --gpu-memory-gib 80 --global-batch-size 128"
"""The command line --help opens with (after the program name)."""
ESSENTIAL = (
    "--hf-config",
    "--preset",
    "--seq-length",
    "--gpus",
    "--gpu-memory-gib",
    "--host-memory-gib",
    "--global-batch-size",
    "--objective",
    "--json",
    "--png",
)
"""The flags --help lists first."""
EXAMPLES = """more examples:
  capture-megatron plan --hf-config Qwen3-8B/config.json --seq-length 4096 --gpus 8 \\
      --gpu-memory-gib 80
  capture-megatron plan $(cat my_pretrain_gpt_flags.txt) --gpus 256 --gpu-memory-gib 80 \\
      --json plan.json --png plan.png

Sizes given (--tensor-model-parallel-size, --micro-batch-size, ...) are kept; the rest is
searched. docs/MEGATRON_FLAGS.md lists how every pretrain_gpt.py flag is read."""
"""Shown after the plan command's options."""


def build_parser(prog: str = "capture-megatron plan") -> flags.FlagParser:
    """The plan command's parser: a whole Megatron-LM command line plus the cluster, and
    --compare-with."""
    p = plan_parser(
        prog,
        usage=USAGE,
        description=flags.summary(__doc__),
        epilog=EXAMPLES,
        example=EXAMPLE,
        essential=ESSENTIAL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_compare_flag(p)
    return p


def print_hf_model(path: str, shape: ModelShape) -> None:
    """What a --hf-config was read as, before anything is profiled or planned: its parameter
    count and the model as Megatron-LM flags."""
    count = parameter_count(shape)
    print(
        f"--hf-config {path}: {count / 1e9:.2f}B parameters ({count:,}) as megatron-core builds it"
    )
    print("model_args: " + " ".join(model_args(shape)), flush=True)


def request_of(ns: argparse.Namespace, cluster: Cluster, fixed_plan: bool = False) -> Request:
    """The API's Request for the parsed command line, printing what an --hf-config was read as
    as soon as it is read."""
    hf_config = getattr(ns, "hf_config", None)
    printed = (lambda shape: print_hf_model(hf_config, shape)) if hf_config else None
    return read_request(ns, cluster, fixed_plan, printed)


def plan_and_report(
    ns: argparse.Namespace,
    cluster: Cluster,
    progress: bool,
    fixed_plan: bool = False,
    memory: MemoryModel | ModelSource | None = None,
) -> PlanResult:
    """Plan the flags' model for `cluster` through the API (`fixed_plan`: predict the run the
    flags describe; `memory`: this memory model or source instead of --memory-model or profiling
    on the spot); print the table and write --json / --png."""
    from capture_megatron.cli.render import print_plan, save_plan_png

    prepare_outputs(ns)
    result = forecast(request_of(ns, cluster, fixed_plan), memory, progress)
    print_plan(result)
    if ns.json:
        result.write(ns.json)
    if ns.png:
        save_plan_png(result, ns.png)
    return result


def run_plan(ns: argparse.Namespace, gpus: int | None = None) -> PlanResult:
    """plan_and_report for the cluster the flags describe (`gpus` when the command knows them)."""
    return plan_and_report(ns, cluster_of(ns, gpus), ns.progress)


def main(argv: list[str]) -> int:
    """Entry point."""
    ns = flags.parse_flags(build_parser(), argv)
    cluster = cluster_of(ns)
    result = plan_and_report(ns, cluster, ns.progress)
    if ns.compare_with:
        comparison = compare(ns, cluster, result)
        print_comparison(comparison)
        if ns.json:
            add_to_json(ns.json, comparison)
    return 0
