"""`capture-megatron plan <a Megatron-LM command line> --gpus N --gpu-memory-gib G`: the
memory-balanced pipeline layout and TP/PP/DP/VPP choice for a cluster.

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
from capture_megatron.config import Cluster, ModelShape
from capture_megatron.config.context import context_problem
from capture_megatron.config.kernels import kernel_set
from capture_megatron.config.training import NOT_ADAM
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import flags, megatron_lm
from capture_megatron.plan import PlanOptions, PlanResult, model_notes, plan
from capture_megatron.plan.window import latent_problem, window_problem


def build_parser(prog: str = "capture-megatron plan") -> flags.FlagParser:
    """The plan command's parser: a whole Megatron-LM command line plus the cluster."""
    p = flags.FlagParser(prog=prog, description=flags.summary(__doc__))
    add_plan_flags(p)
    add_megatron_line(p)
    return p


def _check_window(
    ns: argparse.Namespace, shape: ModelShape, device: str, options: PlanOptions
) -> None:
    """Refuse a sliding window or a context-parallel attention the kernels' memory model does not
    hold before profiling (plan() refuses them too, once it has the memory model)."""
    if ns.memory_model:
        return
    from capture_megatron.profile import default_device

    kernels, space = options.kernels, options.space
    kind = kernel_set(default_device(device), kernels)
    problem = (
        window_problem(shape, kind, kernels)
        or latent_problem(shape, kind, kernels, max(space.cp or (1,)))
        or context_problem(space.cp, space.cp_comm_type, kind, kernels)
    )
    if problem:
        raise CaptureError(problem + ".")


def plan_and_report(
    ns: argparse.Namespace, cluster: Cluster, device: str, progress: bool, fixed_plan: bool = False
) -> PlanResult:
    """Plan the flags' model for `cluster` on `device`'s memory model (`fixed_plan`: predict the
    run the flags describe); print the table and write --json / --png."""
    from capture_megatron.cli.render import print_plan, save_plan_png

    if getattr(ns, "optimizer", "adam") != "adam":
        raise CaptureError(f"--optimizer {ns.optimizer}: {NOT_ADAM}.")
    ignored = megatron_lm.check(ns) if any(megatron_lm.given(ns)) else ()
    shape, shape_notes = resolve_shape(ns)
    options = plan_options(ns, shape, cluster, device, fixed_plan)
    _check_window(ns, shape, device, options)
    result = plan(shape, cluster, options, memory_of(ns, shape, device, progress))
    sp_note = (
        "--sequence-parallel is off at TP 1, as Megatron-LM turns it off"
        if getattr(ns, "sequence_parallel", False) and result.best.plan.tp == 1
        else ""
    )
    routing = result.routing.notes() if result.routing else ()
    notes = (*shape_notes, *model_notes(shape), *routing, *((sp_note,) if sp_note else ()))
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
