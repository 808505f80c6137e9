"""`capture-megatron verify <plan flags> --nproc N`: plan, train a few iterations, compare per rank.

The training run gets exactly the model flags and the plan's Megatron flags (so what ran is what
was predicted), plus the data and training flags given, on `--nproc` processes under torchrun; its
--memory-report gives each rank's measured peak. Prints predicted vs measured per pipeline rank with
the relative error (on CUDA also the allocator's reserve and the forecast of the same plan made
without the GPU: the GPU kernel set on fake CUDA tensors, what `predict` gives on a machine without
it), writes --json / --png, and exits 1 when any rank's forecast is off by more than --tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

from capture_megatron.api.args import add_plan_flags
from capture_megatron.cache import Calibration, cache_dir, check_writable, record_calibration
from capture_megatron.cli.outputs import prepare_outputs, writable_dir
from capture_megatron.cli.plan import run_plan
from capture_megatron.cli.render import print_checks, save_checks_png
from capture_megatron.config import BuildOptions, OptimOptions, RunOptions
from capture_megatron.errors import CaptureError
from capture_megatron.fields import to_flags
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import data_options
from capture_megatron.planner import PlanResult, model_args, plan_args
from capture_megatron.train.compare import RankCheck, compare
from capture_megatron.train.launch import run_torchrun
from capture_megatron.train.report import MemoryReport

USAGE = (
    "%(prog)s [--hf-config CONFIG | --preset NAME | <Megatron-LM model flags>] --nproc N "
    "[--gpus N] [--device DEVICE] "
    "[--data-path PREFIX | --mock-data] [--tolerance F] [--json FILE] [--png FILE]"
)
"""The verify command's one-line usage (argparse's lists every one of its hundreds of flags)."""
EXAMPLE = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --vocab-size 1024 --micro-batch-size 1 --global-batch-size 8 "
    "--nproc 4 --pipeline-model-parallel-size 4 --device cpu --mock-data --png verify.png"
)
"""The command line --help opens with (after the program name)."""
ESSENTIAL = (
    "--nproc",
    "--hf-config",
    "--preset",
    "--gpus",
    "--gpu-memory-gib",
    "--pipeline-model-parallel-size",
    "--device",
    "--data-path",
    "--mock-data",
    "--tolerance",
    "--json",
    "--png",
)
"""The flags --help lists first."""


def build_parser() -> flags.FlagParser:
    """The plan command's flags plus data/training flags and verify's own."""
    p = flags.FlagParser(
        prog="capture-megatron verify",
        usage=USAGE,
        description=flags.summary(__doc__),
        example=EXAMPLE,
        essential=ESSENTIAL,
    )
    add_plan_flags(p, training=True)
    flags.add_data_flags(p)
    flags.add_training_flags(p, train_iters=4)
    g = p.add_argument_group("verification")
    g.add_argument(
        "--nproc", type=int, required=True, help="training processes (torchrun, this node)"
    )
    g.add_argument(
        "--tolerance", type=float, default=0.02, help="largest accepted |relative error|"
    )
    g.add_argument("--refit", action="store_true", help="store the measured peaks as calibration")
    g.add_argument("--keep", default="", help="directory to keep the memory report in")
    return p


def training_args(ns: argparse.Namespace, result: PlanResult, report_path: str) -> list[str]:
    """The pretrain_gpt flags of the verification run: the plan's, then the data / training
    flags."""
    run = dataclasses.replace(
        flags.from_namespace(RunOptions, ns), progress=False, memory_report=report_path
    )
    options = (
        data_options(ns),
        flags.from_namespace(OptimOptions, ns),
        run,
        flags.from_namespace(BuildOptions, ns),
    )
    return (
        model_args(result.shape)
        + plan_args(result.best.plan)
        + [a for o in options for a in to_flags(o)]
    )


def _report(
    ns: argparse.Namespace, result: PlanResult, rows: list[RankCheck], report: MemoryReport
) -> float:
    """Print, write --json / --png, and (--refit) store calibration; returns the largest |error|."""
    print(
        f"verify: predicted vs measured peak per pipeline rank ({report.device}, "
        f"{report.transformer_impl} spec, megatron-core {result.megatron_core})"
    )
    print_checks(rows, ns.tolerance)
    worst = max(abs(c.error) for c in rows)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(
                {
                    "plan": result.to_plain()["plan"],
                    "megatron_core": result.megatron_core,
                    "ranks": [
                        dict(c.__dict__, error=c.error, without_gpu_error=c.without_gpu_error)
                        for c in rows
                    ],
                    "max_abs_error": worst,
                    "tolerance": ns.tolerance,
                    "device": report.device,
                    "moe_routing": result.routing.to_plain() if result.routing else None,
                },
                f,
                indent=1,
            )
    if ns.png:
        save_checks_png(
            rows, ns.png, f"layout {result.best.plan.layout}: max |error| {100 * worst:.2f}%"
        )
    if ns.refit:
        calibration = [
            Calibration(
                report.device,
                report.transformer_impl,
                c.pp_rank,
                c.predicted_bytes,
                c.measured_bytes,
                report.plan.layout,
                result.shape.hidden_size,
            )
            for c in rows
        ]
        factor = record_calibration(calibration)
        print(f"calibration: {len(rows)} rows added; factor now {factor:.4f}")
    return worst


def main(argv: list[str]) -> int:
    """Entry point: 0 when every rank is within tolerance, 1 otherwise."""
    ns = flags.parse_flags(build_parser(), argv)
    prepare_outputs(ns)  # --json, --png (and --keep) before planning and training
    if ns.keep:
        writable_dir("--keep", ns.keep)
    if ns.gpus is not None and ns.nproc != ns.gpus:
        raise CaptureError(
            f"--nproc {ns.nproc} must equal --gpus {ns.gpus} (verify trains the plan it makes)"
        )
    data_options(ns)  # bad data flags fail before planning
    if ns.refit:
        check_writable(cache_dir())  # before training: the calibration must be kept
    result = run_plan(ns, gpus=ns.nproc)
    with tempfile.TemporaryDirectory(prefix="capture-verify-") as tmp:  # removed afterwards
        report_path = os.path.join(ns.keep or tmp, "memory_report.json")
        rc = run_torchrun(ns.nproc, training_args(ns, result, report_path))
        if rc != 0:
            raise CaptureError(
                f"the training run failed (torchrun exit code {rc}); its output is above"
            )
        report = MemoryReport.read(report_path)
    checks = compare(_forecast_peaks(result, report), report, _without_gpu(ns, result))
    worst = _report(ns, result, checks, report)
    print(f"max |error| {100 * worst:.2f}% (tolerance {100 * ns.tolerance:.1f}%)")
    return 0 if worst <= ns.tolerance else 1


def _forecast_peaks(result: PlanResult, report: MemoryReport) -> tuple[int, ...]:
    """The forecast per pipeline rank that the measured peaks compare with: on the CPU, host and
    device memory are one, so --optimizer-cpu-offload's host bytes (StageMemory.host) count too."""
    peaks = result.best.rank_peaks
    if report.device != "cpu":
        return peaks
    return tuple(p + round(s.host) for p, s in zip(peaks, result.best.stages))


def _without_gpu(ns: argparse.Namespace, result: PlanResult) -> tuple[int, ...] | None:
    """On a GPU (a memory model profiled there): the same plan forecast from the GPU kernel set on
    fake CUDA tensors, what `predict` forecasts for it on a machine without the GPU; None
    elsewhere, and None with a note when that forecast fails (the GPU check stands alone)."""
    if result.origin.device != "cuda":
        return None
    from capture_megatron.api import Request, forecast
    from capture_megatron.api.request import plan_options

    options = plan_options(ns, result.shape, result.cluster, "fake-cuda")
    options = dataclasses.replace(options, fixed=result.best.plan)
    request = Request(result.shape, result.cluster, options, "fake-cuda")
    try:
        return forecast(request, None, ns.progress).best.rank_peaks
    except CaptureError as err:
        print(f"note: no forecast without the GPU (fake CUDA) beside it: {err}")
        return None
