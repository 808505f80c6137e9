"""`capture-megatron launch <plan flags> --nodes K --gpus-per-node G --sbatch job.sh`: a Slurm batch
script.

Plans for K x G GPUs (or takes --plan-json from `capture-megatron plan`), then renders the batch
script (capture_megatron.train.slurm) that trains exactly that plan with the data, training and
checkpoint flags given. With --requeue the ranks save on a signal before the time limit and the job
requeues itself and resumes; a warning (printed and in the script) says when the cost model's run
time exceeds --time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from capture_megatron.api.args import add_plan_flags
from capture_megatron.api.request import cost_model, gpus_per_node, resolve_shape
from capture_megatron.cli.outputs import prepare_outputs
from capture_megatron.cli.plan import run_plan
from capture_megatron.config import (
    BuildOptions,
    CheckpointOptions,
    Kernels,
    ModelShape,
    OptimOptions,
    ParallelPlan,
    RunOptions,
)
from capture_megatron.config.parallel import ParallelFlags
from capture_megatron.errors import CaptureError, require
from capture_megatron.fields import flag_of, flagged_fields, to_flags
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import data_options
from capture_megatron.planner import model_args, plan_args, read_plan
from capture_megatron.planner.result import PlanFile
from capture_megatron.steptime.model import step_seconds
from capture_megatron.train.slurm import SlurmOptions, TrainRun, render
from capture_megatron.train.slurm_time import run_time_warning

SIGNAL = "SIGUSR1"
"""The signal a --requeue job's ranks save and exit on (the script's #SBATCH --signal=B:USR1)."""


USAGE = (
    "%(prog)s [--hf-config CONFIG | --preset NAME | <Megatron-LM model flags>] --nodes K "
    "--gpus-per-node G --sbatch FILE [--plan-json FILE] [--partition P] [--time T] "
    "[--mode torchrun|tasks] [any other pretrain_gpt.py flag]"
)
"""The launch command's one-line usage (argparse's lists every one of its hundreds of flags)."""
EXAMPLE = (
    "--preset llama3-70b --nodes 8 --gpus-per-node 8 --gpu-memory-gib 80 "
    "--global-batch-size 128 --mock-data --partition gpu --time 04:00:00 --sbatch job.sh"
)
"""The command line --help opens with (after the program name)."""
ESSENTIAL = (
    "--hf-config",
    "--preset",
    "--nodes",
    "--gpus-per-node",
    "--gpu-memory-gib",
    "--global-batch-size",
    "--data-path",
    "--plan-json",
    "--sbatch",
    "--partition",
    "--time",
    "--mode",
)
"""The flags --help lists first."""


def build_parser() -> flags.FlagParser:
    """Plan flags + the training run's flags + the Slurm job's."""
    p = flags.FlagParser(
        prog="capture-megatron launch",
        usage=USAGE,
        description=flags.summary(__doc__),
        example=EXAMPLE,
        essential=ESSENTIAL,
    )
    add_plan_flags(p, training=True)
    flags.add_data_flags(p)
    flags.add_training_flags(p)
    flags.add_checkpoint_flags(p)
    flags.add_fields(p, SlurmOptions, "slurm")
    p.add_argument(
        "--exclusive",
        dest="exclusive",
        action="store_true",
        default=True,
        help="Allocate whole nodes (the default; --no-exclusive shares them).",
    )
    return p


_PLAN_SIZES = (
    ("tensor_model_parallel_size", "tp"),
    ("pipeline_model_parallel_size", "pp"),
    ("context_parallel_size", "cp"),
    ("expert_model_parallel_size", "ep"),
    ("micro_batch_size", "micro_batch_size"),
    ("global_batch_size", "global_batch_size"),
)
"""Parallel flags a --plan-json's plan fixes (flag field, ParallelPlan attribute)."""


def _given(argv: list[str], names: set[str]) -> bool:
    return any(a.split("=", 1)[0] in names for a in argv)


def _model_differences(given: ModelShape, planned: ModelShape) -> list[str]:
    """'--flag A (given) vs B (the plan's)' for every model setting that differs."""
    out = []
    for field in dataclasses.fields(ModelShape):
        a, b = getattr(given, field.name), getattr(planned, field.name)
        if a != b:
            spec = flag_of(field)
            name = spec.name if spec else "--bf16 / --fp16 (precision)"
            out.append(f"{name} {a} given, {b} in the plan file")
    return out


def _check_plan_file(ns: argparse.Namespace, argv: list[str], path: str, planned: PlanFile) -> None:
    """Refuse model or parallel flags that contradict the --plan-json (they were ignored)."""
    problems = []
    model_flags = {spec.name for _, spec in flagged_fields(ModelShape)}
    model_flags |= {"--preset", "--hf-config", "--bf16", "--fp16"}
    if _given(argv, model_flags):
        shape, _ = resolve_shape(ns)
        problems += _model_differences(shape, planned.shape)
    fixed = flags.from_namespace(ParallelFlags, ns)
    for name, attr in _PLAN_SIZES:
        value = getattr(fixed, name)
        if value is not None and value != getattr(planned.plan, attr):
            flag_name = "--" + name.replace("_", "-")
            problems.append(f"{flag_name} {value} given, {getattr(planned.plan, attr)} in the plan")
    if problems:
        raise CaptureError(
            f"--plan-json {path} describes another run than the flags given: "
            + "; ".join(problems)
            + ". The plan file fixes the model and the plan: give the flags it was planned with "
            "(or none of them), or plan this model again with `capture-megatron plan --json`."
        )


def _planned(
    ns: argparse.Namespace, opts: SlurmOptions, gpus: int, argv: list[str]
) -> tuple[ModelShape, ParallelPlan]:
    """The model and plan: from --plan-json (checked against the flags given), else planned for
    the job's `gpus`."""
    if opts.plan_json:
        planned = read_plan(opts.plan_json)
        if planned.plan.world_size != gpus:
            raise CaptureError(
                f"--plan-json {opts.plan_json} is a plan for {planned.plan.world_size} GPUs; "
                f"the job has {gpus} ({opts.nodes} nodes x {ns.gpus_per_node})"
            )
        _check_plan_file(ns, argv, opts.plan_json, planned)
        return planned.shape, planned.plan
    result = run_plan(ns, gpus)
    return result.shape, result.best.plan


def _job_gpus(ns: argparse.Namespace, opts: SlurmOptions) -> int:
    """nodes x --gpus-per-node (default: the --gpu-type's), checked against --gpus when given."""
    ns.gpus_per_node = gpus_per_node(ns)
    gpus = opts.nodes * ns.gpus_per_node
    if ns.gpus is not None and ns.gpus != gpus:
        raise CaptureError(
            f"--gpus {ns.gpus} differs from --nodes {opts.nodes} x "
            f"--gpus-per-node {ns.gpus_per_node}"
        )
    return gpus


def _requeue_run(
    opts: SlurmOptions, run: RunOptions, ckpt: CheckpointOptions, argv: list[str]
) -> RunOptions:
    """RunOptions with Megatron-LM's exit-signal handler on SIGUSR1 under --requeue, after
    refusing what would make a requeued start lose its progress."""
    if not opts.requeue:
        return run
    problems = []
    if not ckpt.save:
        problems.append(
            "--requeue needs --save DIR: the ranks save their checkpoint there on the signal "
            "and every requeued start resumes from it"
        )
    for name, value in (
        ("--finetune", ckpt.finetune),
        ("--no-load-optim", ckpt.no_load_optim),
        ("--no-load-rng", ckpt.no_load_rng),
        ("--ckpt-step", ckpt.ckpt_step is not None),
    ):
        if value:
            problems.append(
                f"{name} would apply to every requeued start too, which must resume its own "
                f"checkpoint in full: run the {name} job without --requeue first"
            )
    given = any(a == "--exit-signal" or a.startswith("--exit-signal=") for a in argv)
    if given and run.exit_signal != SIGNAL:
        problems.append(
            f"--exit-signal {run.exit_signal}: --requeue signals the ranks with {SIGNAL}"
        )
    require(problems, "--requeue job")
    return dataclasses.replace(run, exit_signal_handler=True, exit_signal=SIGNAL)


def _time_note(
    ns: argparse.Namespace, shape: ModelShape, plan: ParallelPlan, opts: SlurmOptions, iters: int
) -> str:
    """The warning when the step-time model's run time exceeds --time (GPU jobs: the model
    describes GPUs); the same estimate plan and predict print."""
    if opts.cpu:
        return ""
    model = cost_model(ns, flags.from_namespace(Kernels, ns))
    hw = model.hardware
    basis = f"{hw.name}, {hw.peak_flops / 1e12:.0f} TFLOP/s dense bf16 (--gpu-type)"
    lead = opts.lead if opts.requeue else None
    return run_time_warning(step_seconds(shape, plan, model), iters, opts.time, lead, basis)


def main(argv: list[str]) -> int:
    """Entry point."""
    ns = flags.parse_flags(build_parser(), argv)
    prepare_outputs(ns)  # --sbatch, before planning
    opts = flags.from_namespace(SlurmOptions, ns)
    gpus = _job_gpus(ns, opts)
    ckpt = flags.from_namespace(CheckpointOptions, ns)
    ckpt.require_trainable()
    run = _requeue_run(opts, flags.from_namespace(RunOptions, ns), ckpt, argv)
    shape, plan = _planned(ns, opts, gpus, argv)
    given_ckpt = dataclasses.replace(ckpt, load="") if opts.requeue else ckpt
    optim, build = flags.from_namespace(OptimOptions, ns), flags.from_namespace(BuildOptions, ns)
    options = (data_options(ns), optim, run, given_ckpt, build)
    note = _time_note(ns, shape, plan, opts, run.train_iters)
    job = TrainRun(
        args=tuple(model_args(shape) + plan_args(plan) + [a for o in options for a in to_flags(o)]),
        tp=plan.tp,
        train_iters=run.train_iters,
        save=ckpt.save,
        load=ckpt.load,
        notes=(note,) if note else (),
    )
    with open(opts.sbatch, "w") as f:
        f.write(render(opts, ns.gpus_per_node, job))
    if note:
        print(f"capture-megatron launch: warning: {note}", file=sys.stderr)
    print(
        f"wrote {opts.sbatch}: {opts.nodes} nodes x {ns.gpus_per_node} "
        f"{'processes' if opts.cpu else 'GPUs'}, {opts.mode} mode, layout {plan.layout}"
        f"{', requeued before the time limit' if opts.requeue else ''}; "
        f"submit with: sbatch {opts.sbatch}"
    )
    return 0
