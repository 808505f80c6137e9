"""`capture-megatron plan <a Megatron-LM command line> --gpus N --gpu-memory-gib G`: the
TP/PP/DP/VPP/EP/CP sizes, micro-batch, recompute and pipeline layout for a cluster -- the fastest
plan that fits (default), the lowest peak (--objective min-peak) or the fewest GPUs (min-gpus).

Parallel sizes given on the command line are fixed, the rest searched; with
--pipeline-model-parallel-layout nothing is searched and the plan is only predicted. Every
pretrain_gpt.py flag is accepted: those that cannot change memory are ignored (and listed), those
that change it in a way not modelled are refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses

from capture_megatron.cli.inputs import (
    add_megatron_line,
    add_plan_flags,
    cluster_of,
    memory_of,
    plan_options,
    resolve_shape,
)
from capture_megatron.cli.outputs import prepare_outputs
from capture_megatron.config import Cluster, ModelShape
from capture_megatron.config.context import context_problem
from capture_megatron.config.fp8 import fp8_problem
from capture_megatron.config.hf_count import parameter_count
from capture_megatron.config.kernels import kernel_set, tp_overlap_problem
from capture_megatron.config.optimizer_offload import fp8_offload_problem
from capture_megatron.config.training import (
    NOT_ADAM,
    BuildOptions,
    CheckpointOptions,
    OptimOptions,
    RunOptions,
)
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, ModelSource
from capture_megatron.flags import megatron_lm
from capture_megatron.flags import parser as flags
from capture_megatron.plan import PlanOptions, PlanResult, model_args, model_notes, plan
from capture_megatron.plan.limits import too_large
from capture_megatron.plan.planner import global_batch
from capture_megatron.plan.window import latent_problem, window_problem
from capture_megatron.predict.layers import micro_batch_problem

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
    """The plan command's parser: a whole Megatron-LM command line plus the cluster."""
    p = flags.FlagParser(
        prog=prog,
        usage=USAGE,
        description=flags.summary(__doc__),
        epilog=EXAMPLES,
        example=EXAMPLE,
        essential=ESSENTIAL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_plan_flags(p)
    add_megatron_line(p)
    return p


def _check_window(
    ns: argparse.Namespace, shape: ModelShape, device: str, options: PlanOptions
) -> None:
    """Refuse FP8, a sliding window or a context-parallel attention the kernels' memory model
    does not hold before profiling (plan() refuses them too, once it has the memory model), and
    --optimizer-cpu-offload with FP8 parameters as Megatron-LM does."""
    kernels = options.kernels
    offload = fp8_offload_problem(options.space.ddp, kernels.fp8_param_gather, kernels.fp8_recipe)
    if offload:
        raise CaptureError(offload + ".")
    if ns.memory_model:
        return
    from capture_megatron.profile import default_device

    kernels, space, given = options.kernels, options.space, options.fixed
    kind = kernel_set(default_device(device), kernels)
    tp, sp = (given.tp, given.sequence_parallel) if given is not None else (0, True)
    problem = (
        fp8_problem(kind, kernels)
        or tp_overlap_problem(kind, kernels, tp, sp)
        or window_problem(shape, kind, kernels)
        or latent_problem(shape, kind, kernels, max(space.cp or (1,)))
        or context_problem(space.cp, space.cp_comm_type, kind, kernels)
    )
    if problem:
        raise CaptureError(problem + ".")


def print_hf_model(path: str, shape: ModelShape) -> None:
    """What a --hf-config was read as, before anything is profiled or planned: its parameter
    count and the model as Megatron-LM flags."""
    count = parameter_count(shape)
    print(
        f"--hf-config {path}: {count / 1e9:.2f}B parameters ({count:,}) as megatron-core builds it"
    )
    print("model_args: " + " ".join(model_args(shape)), flush=True)


TRAINING_OPTIONS = (OptimOptions, RunOptions, BuildOptions, CheckpointOptions)
"""Training settings a Megatron-LM command line carries besides what is planned."""


def plan_and_report(
    ns: argparse.Namespace,
    cluster: Cluster,
    device: str,
    progress: bool,
    fixed_plan: bool = False,
    memory: MemoryModel | ModelSource | None = None,
) -> PlanResult:
    """Plan the flags' model for `cluster` on `device`'s memory model (`fixed_plan`: predict the
    run the flags describe; `memory`: this memory model or source instead of --memory-model or
    profiling on the spot); print the table and write --json / --png."""
    from capture_megatron.cli.render import print_plan, save_plan_png

    prepare_outputs(ns)
    if getattr(ns, "optimizer", "adam") != "adam":
        raise CaptureError(f"--optimizer {ns.optimizer}: {NOT_ADAM}.")
    for cls in TRAINING_OPTIONS:  # read but not planned with: validated all the same
        if all(hasattr(ns, f.name) for f in dataclasses.fields(cls)):
            flags.from_namespace(cls, ns)
    ignored = megatron_lm.check(ns) if any(megatron_lm.given(ns)) else ()
    shape, shape_notes = resolve_shape(ns)
    if getattr(ns, "hf_config", None):
        print_hf_model(ns.hf_config, shape)
    options = plan_options(ns, shape, cluster, device, fixed_plan)
    gbs = global_batch(options, cluster)
    # searched micro-batches: powers of two dividing the batch (plan.space.micro_batch_sizes)
    too_large(shape, cluster, gbs, max(options.space.micro_batch_size, default=gbs & -gbs))
    _check_window(ns, shape, device, options)
    memory = memory_of(ns, shape, device, progress) if memory is None else memory
    if options.fixed and ns.memory_model and isinstance(memory, MemoryModel):  # a given plan
        problem = micro_batch_problem(memory, shape, options.fixed)
        if problem:
            raise CaptureError(f"--memory-model {ns.memory_model}: {problem}.")
    result = plan(shape, cluster, options, memory)
    sp_note = (
        "--sequence-parallel is off at TP 1, as Megatron-LM turns it off"
        if getattr(ns, "sequence_parallel", False) and result.best.plan.tp == 1
        else ""
    )
    routing = result.routing.notes() if result.routing else ()
    flex = result.margins.hybridep_note(result.shape, result.best.plan)
    offload = _offload_note(result, bool(getattr(ns, "optimizer_cpu_offload", False)))
    extra = tuple(n for n in (sp_note, flex, offload) if n)
    notes = (*shape_notes, *model_notes(shape), *routing, *extra)
    result = dataclasses.replace(result, ignored_flags=ignored, notes=notes)
    print_plan(result)
    if ns.json:
        result.write(ns.json)
    if ns.png:
        save_plan_png(result, ns.png)
    return result


def run_plan(ns: argparse.Namespace, gpus: int | None = None) -> PlanResult:
    """plan_and_report for the cluster the flags describe (`gpus` when the command knows them)."""
    return plan_and_report(ns, cluster_of(ns, gpus), ns.device, ns.progress)


def main(argv: list[str]) -> int:
    """Entry point."""
    run_plan(flags.parse_flags(build_parser(), argv))
    return 0


def _offload_note(result: PlanResult, given: bool = True) -> str:
    """With --optimizer-cpu-offload: what it saves on the device and costs per step, on the rank
    with the most host bytes ('' without offload); `given` False: the planner turned it on, and
    says with which flags."""
    from capture_megatron.plan.costmodel import step_time
    from capture_megatron.plan.offload_cost import offload_note, state_saved, without_offload

    plan = result.best.plan
    if not plan.ddp.optimizer_cpu_offload:
        return ""
    stage = max(result.best.stages, key=lambda s: s.host)
    saved = state_saved(result.shape.dtype, plan, stage.optimizer, stage.host)
    seconds = None
    if result.on_gpu:
        before = step_time(result.shape, without_offload(plan), result.cost).seconds
        seconds = step_time(result.shape, plan, result.cost).seconds - before
    chosen = "" if given else f"{CHOSEN_OFFLOAD}; "
    return chosen + offload_note(plan, stage.host, saved, seconds)


CHOSEN_OFFLOAD = (
    "the planner offloads the optimizer (--optimizer-cpu-offload, searched where it fits the "
    "model on fewer GPUs or beats recompute and more stages; --optimizer-offload-fraction 0 keeps "
    "it off): --use-precision-aware-optimizer, which Megatron-LM needs for it, is on at its "
    "default fp32 dtypes and changes no bytes, as HybridDeviceOptimizer takes none of its dtypes "
    "(megatron-core 0.16.1 optimizer/__init__.py, param_update_in_fp32=True)"
)
"""What plan says when it chose --optimizer-cpu-offload itself."""
