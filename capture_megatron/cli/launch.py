"""`capture-megatron launch <plan flags> --nodes K --gpus-per-node G --sbatch job.sh`: a Slurm batch
script.

Plans for K x G GPUs (or takes --plan-json from `capture-megatron plan`), then renders the batch
script (capture_megatron.train.slurm) that trains exactly that plan with the data, training and
checkpoint flags given.
"""

from __future__ import annotations

import argparse

from capture_megatron.cli.inputs import add_plan_flags
from capture_megatron.cli.plan import run_plan
from capture_megatron.config import (
    CheckpointOptions,
    ModelShape,
    OptimOptions,
    ParallelPlan,
    RunOptions,
)
from capture_megatron.config.fields import to_flags
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import flags
from capture_megatron.megatron.args import data_options
from capture_megatron.plan import model_args, plan_args, read_plan
from capture_megatron.train.slurm import SlurmOptions, render


def build_parser() -> flags.FlagParser:
    """Plan flags + the training run's flags + the Slurm job's."""
    p = flags.FlagParser(prog="capture-megatron launch", description=flags.summary(__doc__))
    add_plan_flags(p, training=True)
    flags.add_data_flags(p)
    flags.add_training_flags(p)
    flags.add_checkpoint_flags(p)
    flags.add_fields(p, SlurmOptions, "slurm")
    return p


def _planned(
    ns: argparse.Namespace, opts: SlurmOptions, gpus: int
) -> tuple[ModelShape, ParallelPlan]:
    """The model and plan: from --plan-json, else planned for the job's `gpus`."""
    if opts.plan_json:
        planned = read_plan(opts.plan_json)
        if planned.plan.world_size != gpus:
            raise CaptureError(
                f"--plan-json {opts.plan_json} is a plan for {planned.plan.world_size} GPUs; "
                f"the job has {gpus} ({opts.nodes} nodes x {ns.gpus_per_node})"
            )
        return planned.shape, planned.plan
    result = run_plan(ns, gpus)
    return result.shape, result.best.plan


def main(argv: list[str]) -> int:
    """Entry point."""
    ns = flags.parse_flags(build_parser(), argv)
    opts = flags.from_namespace(SlurmOptions, ns)
    if ns.gpus_per_node < 1:
        raise CaptureError(f"--gpus-per-node {ns.gpus_per_node} must be at least 1")
    gpus = opts.nodes * ns.gpus_per_node
    if ns.gpus is not None and ns.gpus != gpus:
        raise CaptureError(
            f"--gpus {ns.gpus} differs from --nodes {opts.nodes} x "
            f"--gpus-per-node {ns.gpus_per_node}"
        )
    options = (
        data_options(ns),
        flags.from_namespace(OptimOptions, ns),
        flags.from_namespace(RunOptions, ns),
        flags.from_namespace(CheckpointOptions, ns),
    )
    shape, plan = _planned(ns, opts, gpus)
    train_args = model_args(shape) + plan_args(plan) + [a for o in options for a in to_flags(o)]
    with open(opts.sbatch, "w") as f:
        f.write(render(opts, ns.gpus_per_node, train_args, plan.tp))
    print(
        f"wrote {opts.sbatch}: {opts.nodes} nodes x {ns.gpus_per_node} "
        f"{'processes' if opts.cpu else 'GPUs'}, {opts.mode} mode, layout {plan.layout}; "
        f"submit with: sbatch {opts.sbatch}"
    )
    return 0
