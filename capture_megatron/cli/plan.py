"""`capture-megatron plan <model and training flags> --gpus N --gpu-memory-gib G [--objective ...]`.

Parallel sizes given on the command line are fixed, the rest searched; with
--pipeline-model-parallel-layout nothing is searched and the plan is only predicted.
"""

from __future__ import annotations

import argparse
import dataclasses

from capture_megatron.cache import calibration_factor
from capture_megatron.config import GIB, Cluster, ModelShape, ParallelFlags, hf, presets
from capture_megatron.config.resolve import parallel_plan
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, ModelSource, read_model
from capture_megatron.megatron import flags
from capture_megatron.megatron.args import model_shape, shape_overrides
from capture_megatron.plan import PlanOptions, PlanResult, plan, space_from


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """Model flags, parallel flags (fixing values), PlanOptions and the cluster / output flags."""
    flags.add_model_flags(p)
    flags.add_parallel_flags(p)
    flags.add_fields(p, PlanOptions, "planning")
    g = p.add_argument_group("model source, cluster and outputs")
    g.add_argument("--preset", help=f"model shape by name: {', '.join(presets.PRESETS)}")
    g.add_argument("--hf-config", help="a Hugging Face config.json (Llama, Mistral, Qwen2 style)")
    g.add_argument("--gpus", type=int, help="processes/GPUs available (required)")
    g.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="memory per GPU (default with --device cpu: this host's)",
    )
    g.add_argument(
        "--gpus-per-node", type=int, default=8, help="tensor parallelism stays inside a node"
    )
    g.add_argument(
        "--device",
        default="",
        help="memory model device: cpu, cuda or fake (default: cuda if available, else fake)",
    )
    g.add_argument(
        "--memory-model", default="", help="a fitted memory_model.json (else profile on the spot)"
    )
    g.add_argument("--json", default="", help="write the plan JSON here")
    g.add_argument("--png", default="", help="write the per-stage memory breakdown plot here")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def build_parser(prog: str = "capture-megatron plan") -> flags.FlagParser:
    """The plan command's parser."""
    p = flags.FlagParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    add_plan_flags(p)
    return p


def resolve_shape(ns: argparse.Namespace) -> ModelShape:
    """The model: --preset or --hf-config, with any model flag on the command line overriding it."""
    if ns.preset and ns.hf_config:
        raise CaptureError("give --preset or --hf-config, not both")
    if not ns.preset and not ns.hf_config:
        return model_shape(ns)
    base = (
        presets.preset(ns.preset) if ns.preset else hf.from_hf_config(ns.hf_config, ns.seq_length)
    )
    return dataclasses.replace(base, **shape_overrides(ns))


def cluster_of(ns: argparse.Namespace, gpus: int | None = None) -> Cluster:
    """The cluster from --gpus (or `gpus`, when the command knows them) / --gpu-memory-gib /
    --gpus-per-node / the device."""
    device = "cpu" if ns.device == "cpu" else "cuda"
    gpus = ns.gpus if gpus is None else gpus
    if gpus is None:
        raise CaptureError("--gpus is required (how many GPUs or processes the plan may use)")
    memory = ns.gpu_memory_gib
    if memory is None:
        if device != "cpu":
            raise CaptureError("--gpu-memory-gib is required (memory per GPU, e.g. 80)")
        import psutil

        memory = psutil.virtual_memory().total / GIB
    return Cluster(
        gpus=gpus,
        gpu_memory_bytes=int(memory * GIB),
        gpus_per_node=ns.gpus_per_node,
        device=device,
    )


def plan_options(
    ns: argparse.Namespace, shape: ModelShape, cluster: Cluster, device: str
) -> PlanOptions:
    """PlanOptions from the flags: the fixed sizes, the batch, a given layout, the calibration of
    the memory model's device (none with --memory-model)."""
    fixed = flags.from_namespace(ParallelFlags, ns)
    given_plan = (
        parallel_plan(fixed, shape, cluster.gpus) if fixed.pipeline_model_parallel_layout else None
    )
    scale = 1.0
    if not ns.memory_model:
        from capture_megatron.profile import default_device

        scale = calibration_factor(default_device(device))
    return flags.from_namespace(
        PlanOptions,
        ns,
        space=space_from(fixed),
        fixed=given_plan,
        global_batch_size=fixed.global_batch_size or 0,
        calibration=scale,
    )


def memory_of(
    ns: argparse.Namespace, shape: ModelShape, device: str, progress: bool
) -> MemoryModel | ModelSource:
    """The memory model from --memory-model, or a source that profiles on the spot (cached)."""
    if ns.memory_model:
        return read_model(ns.memory_model)
    from capture_megatron.profile import memory_source

    return memory_source(shape, device, progress=progress)


def plan_and_report(
    ns: argparse.Namespace, cluster: Cluster, device: str, progress: bool
) -> PlanResult:
    """Plan the flags' model for `cluster` on `device`'s memory model; print the table and write
    --json / --png."""
    from capture_megatron.cli.render import print_plan, save_plan_png

    shape = resolve_shape(ns)
    options = plan_options(ns, shape, cluster, device)
    result = plan(shape, cluster, options, memory_of(ns, shape, device, progress))
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
