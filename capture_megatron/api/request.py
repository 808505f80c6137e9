"""A Request: what `predict` and `plan` are asked, as typed objects -- the model (from flags,
--preset or --hf-config; the vocabulary from the tokenizer when --vocab-size is absent), the
cluster, the PlanOptions, where the memory model comes from -- read once from a Megatron-LM command
line (read_request) or built from objects by a Python caller."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from capture_megatron.cache import calibration_factor
from capture_megatron.config import (
    GIB,
    Cluster,
    Kernels,
    ModelShape,
    ParallelFlags,
    hf,
    presets,
)
from capture_megatron.config.kernels import TE_FUSED_BACKENDS, kernel_set
from capture_megatron.config.training import (
    BuildOptions,
    CheckpointOptions,
    OptimOptions,
    RunOptions,
)
from capture_megatron.errors import CaptureError, require
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.features.optimizers import Optimizer
from capture_megatron.features.recompute import Recompute
from capture_megatron.flags import megatron_lm
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import model_shape, overridden, shape_overrides
from capture_megatron.flags.resolve import parallel_plan, split_notes
from capture_megatron.forecast.routing import lr_sum
from capture_megatron.planner import PlanOptions, space_from
from capture_megatron.planner.space import overlap_space, virtual_stage_problem
from capture_megatron.rules.flags import (
    activation_offload_problem,
    fsdp_run_problems,
    muon_run_problems,
)
from capture_megatron.rules.megatron import module_problems
from capture_megatron.steptime.constants import fitted
from capture_megatron.steptime.hardware import Hardware, HardwareFlags, ok
from capture_megatron.steptime.model import CostModel
from capture_megatron.steptime.settings import StepSettings


@dataclass(frozen=True)
class Request:
    """What predict and plan are asked: the model, the cluster, how to plan (or, with a fixed plan
    in options.fixed, the run to predict), and where the memory model comes from."""

    shape: ModelShape
    """The model."""
    cluster: Cluster
    """Where it runs: GPUs (or CPU processes), memory per GPU, GPUs per node."""
    options: PlanOptions = PlanOptions()
    """How to plan: the objective, what is fixed and what searched, the kernels, the step-time
    model, the memory margins; options.fixed set: predict that plan instead of searching."""
    device: str = ""
    """The memory model's device: cuda, fake-cuda (alias fake), cpu or fake-cpu; '': cuda if
    available, else fake-cuda."""
    memory_model: str = ""
    """A fitted memory_model.json to predict with ('': profile on the spot, cached)."""
    model_notes: tuple[str, ...] = ()
    """How the model was read (an HF config's defaults, where the vocabulary came from)."""
    ignored_flags: tuple[str, ...] = ()
    """Megatron-LM flags of the command line that cannot change memory: accepted, listed."""
    hf_config: str = ""
    """The HF config.json the model was read from ('' if none)."""


MAX_GPU_GIB = 1 << 20
"""Largest --gpu-memory-gib taken (1 PiB per device: a typo beyond it, not a GPU)."""
GPT2_VOCAB = 50257
"""Entries of GPT-2's BPE vocab.json: Megatron-LM's default tokenizer (GPT2BPETokenizer)."""


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
        moe_permute_fusion=kernels.moe_permute_fusion,
        # read where the command line carries them (the MoE knobs of issue 51)
        moe_shared_expert_overlap=bool(getattr(ns, "moe_shared_expert_overlap", False)),
        delay_wgrad_compute=bool(getattr(ns, "delay_wgrad_compute", False)),
        cuda_graph_impl=str(getattr(ns, "cuda_graph_impl", None) or "none"),
        cuda_graph_scope=tuple(str(x) for x in getattr(ns, "cuda_graph_scope", None) or ()),
    )
    return CostModel(hardware_of(ns), settings, constants)


SPLIT_FLAGS = (
    "pipeline_model_parallel_layout",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)
"""ParallelFlags that give the pipeline split itself: with any of them `plan` predicts the run
the flags describe (sizes not given are 1, as in Megatron-LM) instead of searching a split."""


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
    whole = fixed_plan or any(getattr(fixed, f) for f in SPLIT_FLAGS)
    given_plan = parallel_plan(fixed, shape, cluster.gpus, ddp) if whole else None
    scale = 1.0
    kernels = flags.from_namespace(Kernels, ns)
    if not ns.memory_model:
        from capture_megatron.profile import default_device

        scale = calibration_factor(default_device(device))
        # before profiling: can the kernel set run fine-grained offloading at all?
        kind = kernel_set(default_device(device), kernels)
        problem = activation_offload_problem(ddp.activation_offload, kind)
        if problem:
            raise CaptureError(problem + ".")
    space = space_from(fixed, ddp)
    ckpt = getattr(ns, "ckpt_format", "torch_dist")
    hashes = megatron_lm.given(ns).get("--check-weight-hash-across-dp-replicas-interval")
    if (
        ckpt not in ("torch_dist", "fsdp_dtensor")
        or hashes is not None
        or fixed.use_distributed_optimizer
    ):  # what Megatron-LM asserts of Megatron-FSDP (features.fsdp), or the distributed optimizer
        # asked for: no ZeRO-3 twins; a plan that takes one names --ckpt-format fsdp_dtensor in
        # place of the default torch_dist
        space = dataclasses.replace(space, fsdp=(False,))
    problem = "" if whole else virtual_stage_problem(shape, cluster.gpus, space)
    if problem:  # (a whole plan's split is resolved, and refused, as train resolves it)
        raise CaptureError(problem)
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


def with_router_lr(shape: ModelShape, ns: argparse.Namespace) -> ModelShape:
    """`shape` with its experts' router_lr_sum when the command line gives --train-iters (a run
    of known length; capture_megatron.forecast.routing): --lr over --train-iters with the
    warm-up of --lr-warmup-iters, or --lr-warmup-fraction of --lr-decay-iters (else of
    --train-iters), as Megatron-LM's scheduler takes them."""
    run, optim = flags.given(RunOptions, ns), flags.given(OptimOptions, ns)
    if not shape.moe.enabled or "train_iters" not in run:
        return shape
    iterations = run["train_iters"]
    lr = optim.get("lr", OptimOptions.lr)
    fraction = megatron_lm.given(ns).get("--lr-warmup-fraction")
    decay = optim.get("lr_decay_iters") or iterations
    warmup = fraction * decay if fraction is not None else optim.get("lr_warmup_iters", 0)
    total = lr_sum(lr, warmup, iterations)
    return dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, router_lr_sum=total))


TRAINING_OPTIONS = (OptimOptions, RunOptions, BuildOptions, CheckpointOptions)
"""Training settings a Megatron-LM command line carries besides what is planned."""


def read_request(
    ns: argparse.Namespace,
    cluster: Cluster,
    fixed_plan: bool = False,
    on_model: Callable[[ModelShape], None] | None = None,
) -> Request:
    """The Request a parsed command line describes (`fixed_plan`: predict the run it describes;
    `on_model`: called with the model as soon as it is read, before the planning options are:
    the command line prints what an HF config was read as). Refuses, with one paragraph, what
    cannot be read or is not modelled: a flag that changes memory in a way not modelled, invalid
    training settings, what Megatron-LM asserts of Muon and Megatron-FSDP among the run's
    settings."""
    for cls in TRAINING_OPTIONS:  # read but not planned with: validated all the same
        if all(hasattr(ns, f.name) for f in dataclasses.fields(cls)):
            flags.from_namespace(cls, ns)
    ckpt_format = getattr(ns, "ckpt_format", "torch_dist")
    muon = muon_run_problems(
        flags.from_namespace(Optimizer, ns),
        bool(getattr(ns, "overlap_param_gather", False)),
        ckpt_format,
    )
    hashes = megatron_lm.given(ns).get("--check-weight-hash-across-dp-replicas-interval")
    fsdp = fsdp_run_problems(flags.from_namespace(Fsdp, ns), ckpt_format, hashes is not None)
    require(muon + fsdp, "optimizer settings")
    ignored = megatron_lm.check(ns) if any(megatron_lm.given(ns)) else ()
    shape, notes = resolve_shape(ns)
    shape = with_router_lr(shape, ns)
    if on_model is not None:
        on_model(shape)
    options = plan_options(ns, shape, cluster, ns.device, fixed_plan)
    notes += split_notes(flags.from_namespace(ParallelFlags, ns))
    return Request(
        shape,
        cluster,
        options,
        ns.device,
        ns.memory_model,
        notes,
        ignored,
        getattr(ns, "hf_config", None) or "",
    )
