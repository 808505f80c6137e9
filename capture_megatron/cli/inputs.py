"""What the planning commands read from their command lines: the model (flags, --preset or
--hf-config; the vocabulary from the tokenizer when --vocab-size is absent), the cluster, the
PlanOptions, and the memory model or the source that profiles it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from capture_megatron import __version__
from capture_megatron.cache import calibration_factor
from capture_megatron.config import (
    GIB,
    Cluster,
    DataOptions,
    Kernels,
    ModelShape,
    ParallelFlags,
    hf,
    presets,
)
from capture_megatron.config.hardware import Hardware, HardwareFlags, ok
from capture_megatron.config.kernels import TE_FUSED_BACKENDS, kernel_set
from capture_megatron.config.recompute import Recompute, module_problems
from capture_megatron.config.resolve import parallel_plan
from capture_megatron.config.runtime import StepSettings
from capture_megatron.errors import CaptureError, require
from capture_megatron.fit import MemoryModel, ModelSource, read_model
from capture_megatron.fit.io import check_fitted
from capture_megatron.flags import megatron_lm
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import model_shape, overridden, shape_overrides
from capture_megatron.plan import PlanOptions, space_from
from capture_megatron.plan.calibration import fitted
from capture_megatron.plan.costmodel import CostModel
from capture_megatron.plan.space import overlap_space

MAX_GPU_GIB = 1 << 20
"""Largest --gpu-memory-gib taken (1 PiB per device: a typo beyond it, not a GPU)."""
GPT2_VOCAB = 50257
"""Entries of GPT-2's BPE vocab.json: Megatron-LM's default tokenizer (GPT2BPETokenizer)."""


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The model source, the cluster, the memory model and the outputs."""
    g = p.add_argument_group("model source, cluster and outputs")
    g.add_argument("--preset", help=f"model shape by name: {', '.join(presets.PRESETS)}")
    g.add_argument(
        "--hf-config",
        help="a Hugging Face config.json, or the model directory holding it (llama, mistral, "
        "gemma, qwen2, qwen3, olmo2, phi3, mixtral, qwen2_moe, qwen3_moe, deepseek_v2, "
        "deepseek_v3; gemma2 and gemma3_text are read but refused); the sequence length: "
        "--seq-length",
    )
    g.add_argument("--gpus", type=int, help="processes/GPUs available (required)")
    g.add_argument(
        "--gpu-memory-gib",
        type=float,
        help=(
            "GiB one process may take of its GPU; a plan fits when its forecast plus "
            "--reserve-fraction and --context-gib is at most this (default: the --gpu-type's "
            "memory as the driver reports it, 79.65 for an H100 SXM; --device cpu: this host's)"
        ),
    )
    g.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node; tensor parallelism stays inside a node (default: the --gpu-type's, "
        "8 for HGX / DGX nodes)",
    )
    g.add_argument(
        "--device",
        default="",
        help="memory model device: cuda (a real GPU), fake-cuda (alias fake: the GPU kernels on "
        "fake CUDA tensors), cpu or fake-cpu (CPU kernels: for CPU runs); default: cuda if "
        "available, else fake-cuda",
    )
    g.add_argument(
        "--memory-model", default="", help="a fitted memory_model.json (else profile on the spot)"
    )
    g.add_argument("--json", default="", help="write the result as JSON here")
    g.add_argument("--png", default="", help="write the per-stage memory breakdown plot here")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    flags.add_fields(p, HardwareFlags, "hardware profile (step-time estimate; capture-megatron)")


def add_plan_flags(p: argparse.ArgumentParser, training: bool = False) -> None:
    """The cluster flags (what a user gives first), then model, kernel and parallel flags and
    PlanOptions (`training`: the kernels' defaults of capture-megatron's own training, for
    commands that train the plan)."""
    add_cluster_flags(p)
    flags.add_model_flags(p)
    flags.add_kernel_flags(p, training=training)
    flags.add_parallel_flags(p)
    flags.add_fields(p, PlanOptions, "planning")


def add_megatron_line(p: argparse.ArgumentParser) -> None:
    """The rest of a Megatron-LM pretrain_gpt.py command line, with Megatron-LM's defaults: the
    training, data and checkpoint flags capture-megatron knows, then every other flag
    (capture_megatron.flags.megatron_lm: ignored when it cannot change memory, else refused)."""
    flags.add_training_flags(p)
    flags.add_fields(
        p, DataOptions, "data (Megatron flags)", defaults={"tokenizer_type": "GPT2BPETokenizer"}
    )
    flags.add_checkpoint_flags(p)
    megatron_lm.add_megatron_lm_flags(p)


def tokenizer_vocab(ns: argparse.Namespace) -> tuple[int, str]:
    """(vocabulary, how it was found) from the tokenizer flags, for a line without --vocab-size."""
    kind = getattr(ns, "tokenizer_type", None)
    if kind == "GPT2BPETokenizer":
        path = ns.vocab_file
        if path and os.path.isfile(path):
            with open(path) as f:
                return len(json.load(f)), f"GPT-2 BPE vocabulary read from {path}"
        return GPT2_VOCAB, (
            f"GPT-2 BPE vocabulary of {GPT2_VOCAB} assumed (--vocab-file "
            f"{path or '(none)'} is not readable here)"
        )
    if kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        from capture_megatron.data.tokenizers import TokenizerOptions, build_tokenizer

        tok = build_tokenizer(
            TokenizerOptions(kind, ns.tokenizer_model, ns.vocab_file, ns.merge_file)
        )
        return tok.vocab_size, f"vocabulary of {ns.tokenizer_model}"
    raise CaptureError(
        f"give --vocab-size (the vocabulary of --tokenizer-type {kind} is not known here)"
    )


def resolve_shape(ns: argparse.Namespace) -> tuple[ModelShape, tuple[str, ...]]:
    """The model (--preset or --hf-config, with any model flag overriding it; else the model flags)
    and notes on how it was read: the HF config's defaults and choices (sequence length, window,
    precision), how the vocabulary was found."""
    if ns.preset and ns.hf_config:
        raise CaptureError("give --preset or --hf-config, not both")
    if ns.preset:
        return overridden(presets.preset(ns.preset), ns), ()
    if ns.hf_config:
        dtype = shape_overrides(ns).get("dtype")
        read = hf.read_hf_config(ns.hf_config, ns.seq_length, dtype).checked()
        return overridden(read.shape, ns), read.notes
    if ns.vocab_size is not None or not hasattr(ns, "tokenizer_type"):
        return model_shape(ns), ()
    vocab, how = tokenizer_vocab(ns)
    return model_shape(ns, vocab), (how,)


def cluster_of(
    ns: argparse.Namespace, gpus: int | None = None, need_memory: bool = True
) -> Cluster:
    """The cluster from --gpus (or `gpus`, when the command knows them) / --gpu-memory-gib /
    --gpus-per-node / the device (`need_memory` False: memory may stay unknown, 0)."""
    device = "cpu" if ns.device in ("cpu", "fake-cpu") else "cuda"
    gpus = ns.gpus if gpus is None else gpus
    if gpus is None:
        raise CaptureError("--gpus is required (how many GPUs or processes the plan may use)")
    memory = ns.gpu_memory_gib
    if memory is not None and not (ok(memory) and memory <= MAX_GPU_GIB):  # also nan, inf
        raise CaptureError(
            f"--gpu-memory-gib {memory:g} must be positive and finite, at most {MAX_GPU_GIB} GiB"
        )
    if memory is None and device == "cpu":
        import psutil

        memory = psutil.virtual_memory().total / GIB
    elif memory is None and (need_memory or device == "cuda"):
        memory = hardware_of(ns).memory_bytes / GIB  # the --gpu-type's
    return Cluster(
        gpus=gpus,
        gpu_memory_bytes=int((memory or 0) * GIB),
        gpus_per_node=gpus_per_node(ns),
        device=device,
    )


def gpus_per_node(ns: argparse.Namespace) -> int:
    """--gpus-per-node, else the --gpu-type's (CaptureError for a count below 1)."""
    given = ns.gpus_per_node
    if given is not None and given < 1:
        raise CaptureError(f"--gpus-per-node {given} must be at least 1")
    return given if given is not None else hardware_of(ns).gpus_per_node


def hardware_of(ns: argparse.Namespace) -> Hardware:
    """The --gpu-type's profile with the hardware flags given (CaptureError for a bad value)."""
    hw = flags.from_namespace(HardwareFlags, ns)
    return hw.resolve(
        ns.gpus_per_node, ns.gpu_memory_gib if ns.device not in ("cpu", "fake-cpu") else None
    )


def cost_model(ns: argparse.Namespace, kernels: Kernels) -> CostModel:
    """The step-time model of the run the flags describe: the hardware profile, the run's
    overlap flags and kernels, and the fitted constants (--gemm-efficiency replaces one)."""
    given = flags.from_namespace(HardwareFlags, ns)
    constants = fitted()
    if given.gemm_efficiency is not None:
        if not (ok(given.gemm_efficiency) and given.gemm_efficiency <= 1):
            raise CaptureError(
                f"--gemm-efficiency {given.gemm_efficiency:g} must be in (0, 1] (a fraction of "
                "peak FLOP/s)"
            )
        constants = dataclasses.replace(constants, gemm_efficiency=given.gemm_efficiency)
    gpu = kernels.for_gpu()
    fused = gpu.transformer_impl == "transformer_engine" and gpu.attention_backend in (
        TE_FUSED_BACKENDS
    )
    settings = StepSettings(
        overlap_grad_reduce=bool(getattr(ns, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(ns, "overlap_param_gather", False)),
        fused_attention=fused,
        deterministic=kernels.deterministic_mode,
        gradient_accumulation_fusion=kernels.gradient_accumulation_fusion,
    )
    return CostModel(hardware_of(ns), settings, constants)


def plan_options(
    ns: argparse.Namespace,
    shape: ModelShape,
    cluster: Cluster,
    device: str,
    fixed_plan: bool = False,
) -> PlanOptions:
    """PlanOptions from the flags: the fixed sizes, the batch, the kernels, a given layout (or,
    with `fixed_plan`, the whole run the flags describe), the calibration of the memory model's
    device (none with --memory-model)."""
    fixed = flags.from_namespace(ParallelFlags, ns)
    ddp = flags.ddp_options(ns)
    whole = fixed_plan or bool(fixed.pipeline_model_parallel_layout)
    given_plan = parallel_plan(fixed, shape, cluster.gpus, ddp) if whole else None
    scale = 1.0
    kernels = flags.from_namespace(Kernels, ns)
    if not ns.memory_model:
        from capture_megatron.profile import default_device

        scale = calibration_factor(default_device(device))
        # before profiling: can the kernel set run fine-grained offloading at all?
        problem = ddp.activation_offload.kernel_problem(kernel_set(default_device(device), kernels))
        if problem:
            raise CaptureError(problem + ".")
    space = space_from(fixed, whole, ddp)
    if "selective" in space.recompute:  # what megatron-core refuses is refused, not skipped
        chosen = Recompute.selective(space.recompute_modules).selected
        require(module_problems(shape, chosen), "selective recompute for this model")
    return flags.from_namespace(
        PlanOptions,
        ns,
        space=overlap_space(space, kernels),
        fixed=given_plan,
        global_batch_size=fixed.global_batch_size or 0,
        calibration=scale,
        kernels=kernels,
        cost=cost_model(ns, kernels),
    )


def memory_of(
    ns: argparse.Namespace, shape: ModelShape, device: str, progress: bool
) -> MemoryModel | ModelSource:
    """The memory model from --memory-model, or a source that profiles on the spot (cached)."""
    if ns.memory_model:
        model = read_model(ns.memory_model)
        check_fitted(model, shape, ns.memory_model, __version__)
        return model
    from capture_megatron.profile import memory_source

    return memory_source(shape, device, progress, flags.from_namespace(Kernels, ns))
