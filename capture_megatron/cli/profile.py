"""`capture-megatron profile <Megatron model flags> --device {cpu,fake-cpu,fake-cuda,cuda} --out F`:
measure real Megatron-Core pieces' memory into profile records.

Probes the model's own sizes (anchors: exact predictions later) at the TP sizes and micro-batch
sizes asked for, and by default a design of small shapes on which every regression term is
identifiable, for each variant (recompute / sequence-parallel setting) asked for."""

from __future__ import annotations

import argparse
import time

from capture_megatron.cli.outputs import prepare_outputs
from capture_megatron.config import Kernels, ModelShape, ParallelFlags
from capture_megatron.errors import CaptureError
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import model_shape
from capture_megatron.flags.parser import summary
from capture_megatron.flags.resolve import given_modules, granularity_of
from capture_megatron.profile import ProfileOptions
from capture_megatron.records import Variant, write_records


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CaptureError(f"{what} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise CaptureError(f"{what} {text!r}: expected positive integers")
    return values


USAGE = (
    "%(prog)s [Megatron-LM model flags: --num-layers L --hidden-size H ...] --device DEVICE "
    "--out FILE [--probe-tp 1,2,4] [--variants model|all] [--no-design]"
)
"""The profile command's one-line usage (argparse's lists every one of its hundreds of flags)."""
EXAMPLE = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --vocab-size 1024 --device cpu --out records.jsonl"
)
"""The command line --help opens with (after the program name)."""
ESSENTIAL = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--device",
    "--out",
    "--probe-tp",
    "--variants",
)
"""The flags --help lists first."""


def build_parser() -> flags.FlagParser:
    """Model flags plus the profile command's own."""
    p = flags.FlagParser(
        prog="capture-megatron profile",
        usage=USAGE,
        description=summary(__doc__),
        example=EXAMPLE,
        essential=ESSENTIAL,
    )
    flags.add_model_flags(p)
    flags.add_kernel_flags(p)
    flags.add_parallel_flags(p)
    g = p.add_argument_group("profiling")
    g.add_argument(
        "--device",
        default="",
        help="cpu, fake-cpu (CPU kernels, no data), fake-cuda (alias fake: the GPU kernels on "
        "fake CUDA tensors) or cuda; default: as `plan`, cuda if available, else fake-cuda",
    )
    g.add_argument("--out", required=True, help="records file (JSON lines)")
    g.add_argument(
        "--probe-tp",
        default="",
        help="TP sizes to probe (default: --tensor-model-parallel-size or 1)",
    )
    g.add_argument("--probe-micro-batch-sizes", default="", help="default: --micro-batch-size or 1")
    g.add_argument(
        "--variants",
        choices=["model", "all"],
        default="model",
        help="model: the flags' recompute/SP setting; all: none/selective/full x SP on/off",
    )
    g.add_argument(
        "--no-design", action="store_true", help="probe only the model's own sizes (fast)"
    )
    g.add_argument(
        "--no-timelines",
        action="store_true",
        help="do not record allocation timelines (cpu/fake; without them `fit` regresses transient "
        "peaks instead of replaying them)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def variants_for(ns: argparse.Namespace, shape: ModelShape) -> tuple[Variant, ...]:
    """The variants to profile (selective recompute of the --recompute-modules given)."""
    given = flags.from_namespace(ParallelFlags, ns)
    modules = given_modules(given)
    if ns.variants == "all":
        return tuple(
            Variant.of(shape, rc, sp, modules=modules)
            for rc in ("none", "selective", "full")
            for sp in (False, True)
        )
    rc = granularity_of(given)
    if ns.recompute_num_layers_per_stage:
        rc = "full"
    return (Variant.of(shape, rc, bool(ns.sequence_parallel), modules=modules),)


def options_of(ns: argparse.Namespace, shape: ModelShape) -> ProfileOptions:
    """ProfileOptions from the flags."""
    tps = _ints(ns.probe_tp, "--probe-tp") if ns.probe_tp else (ns.tensor_model_parallel_size or 1,)
    mbs = (
        _ints(ns.probe_micro_batch_sizes, "--probe-micro-batch-sizes")
        if ns.probe_micro_batch_sizes
        else (ns.micro_batch_size or 1,)
    )
    from capture_megatron.profile import default_device

    return ProfileOptions(
        device=default_device(ns.device),
        kernels=flags.from_namespace(Kernels, ns),
        tps=tps,
        micro_batch_sizes=mbs,
        variants=variants_for(ns, shape),
        design=not ns.no_design,
        timelines=not ns.no_timelines,
        progress=not ns.no_progress,
    )


def main(argv: list[str]) -> int:
    """Entry point; returns the exit code."""
    from capture_megatron.profile import profile

    ns = flags.parse_flags(build_parser(), argv)
    prepare_outputs(ns)
    shape = model_shape(ns)
    options = options_of(ns, shape)
    start = time.perf_counter()
    records = profile(shape, options)
    write_records(list(records), ns.out)
    print(
        f"profiled {len(records)} probes on {options.device} (kernels {records[0].kernels}) in "
        f"{time.perf_counter() - start:.1f} s -> {ns.out}"
    )
    return 0
