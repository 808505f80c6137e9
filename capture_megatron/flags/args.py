"""Parsed Megatron flags -> the typed objects between stages (ModelShape, ParallelFlags, the
training options, TrainConfig). The argparse Namespace stops here. Pure Python (no torch)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from capture_megatron.config import (
    BuildOptions,
    CheckpointOptions,
    DataOptions,
    Kernels,
    ModelShape,
    OptimOptions,
    ParallelFlags,
    RunOptions,
    TrainConfig,
)
from capture_megatron.errors import CaptureError, require
from capture_megatron.features.mla import LatentAttention
from capture_megatron.features.moe import Experts
from capture_megatron.flags.parser import ddp_options, from_namespace, given
from capture_megatron.flags.resolve import parallel_plan
from capture_megatron.rules.modelled import trainer_kernels_problem

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
"""ModelShape fields a command line must give (the vocabulary may come from the tokenizer)."""


def precision(ns: argparse.Namespace) -> str | None:
    """The dtype --bf16 / --fp16 ask for (None: neither given)."""
    if ns.bf16 and ns.fp16:
        raise CaptureError("give at most one of --bf16 and --fp16")
    return "bf16" if ns.bf16 else ("fp16" if ns.fp16 else None)


def shape_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """ModelShape fields given on the command line (flags parsed by add_model_flags), precision
    included; --num-query-groups counts only with --group-query-attention."""
    values = given(ModelShape, ns)
    if "num_query_groups" in values and not ns.group_query_attention:
        raise CaptureError(
            f"--num-query-groups {values['num_query_groups']} needs --group-query-attention"
        )
    dtype = precision(ns)
    if dtype is not None:
        values["dtype"] = dtype
    return values


def overridden(base: ModelShape, ns: argparse.Namespace) -> ModelShape:
    """`base` (a preset's or an HF config's model) with the model flags given on the command line
    replacing its fields (MoE and MLA flags replace single fields of its experts / attention)."""
    experts = dataclasses.replace(base.moe, **given(Experts, ns))
    mla = dataclasses.replace(base.mla, **given(LatentAttention, ns))
    return dataclasses.replace(base, **shape_overrides(ns), moe=experts, mla=mla)


def model_shape(ns: argparse.Namespace, vocab_size: int | None = None) -> ModelShape:
    """ModelShape from model flags; `vocab_size` (the tokenizer's) fills in a missing
    --vocab-size."""
    values = shape_overrides(ns)
    missing = [f for f in REQUIRED if f not in values]
    if "vocab_size" not in values and vocab_size is None:
        missing.append("vocab_size")
    require([f"--{f.replace('_', '-')} is required" for f in missing], "model flags")
    given_vocab = values.get("vocab_size")
    if vocab_size is not None and given_vocab is not None and given_vocab < vocab_size:
        raise CaptureError(
            f"--vocab-size {given_vocab} is smaller than the tokenizer's {vocab_size}"
        )
    values.setdefault("vocab_size", vocab_size)
    mla = LatentAttention(**given(LatentAttention, ns))
    return ModelShape(**values, moe=Experts(**given(Experts, ns)), mla=mla)


def data_options(ns: argparse.Namespace) -> DataOptions:
    """Data source and tokenizer; with --mock-data, tokens are drawn below --vocab-size."""
    mock_vocab = (ns.vocab_size or 0) if ns.mock_data else 0
    return from_namespace(DataOptions, ns, mock_vocab_size=mock_vocab)


def train_config(ns: argparse.Namespace, world_size: int, vocab_size: int | None) -> TrainConfig:
    """TrainConfig of a run on `world_size` processes from flags parsed by the training parser."""
    shape = model_shape(ns, vocab_size)
    if getattr(ns, "fine_grained_activation_offloading", False):
        raise CaptureError(
            "--fine-grained-activation-offloading: capture-megatron's trainer does not run it "
            "(megatron-core needs Transformer Engine, CUDA streams and pinned host memory for "
            "it); its memory is forecast by `plan` / `predict` with the GPU kernel set, and "
            "Megatron-LM runs it with the plan's flags"
        )
    ddp = ddp_options(ns)
    if ddp.fsdp.enabled:
        raise CaptureError(
            "--use-megatron-fsdp: capture-megatron's trainer wraps the model in megatron-core's "
            "DDP only (Megatron-FSDP needs CUDA streams, NCCL and DTensor device meshes on CUDA, "
            "which its CPU ranks cannot give); `plan` and `predict` forecast it with the GPU "
            "kernel set (capture_megatron.features.fsdp), and Megatron-LM runs it with the "
            "plan's flags"
        )
    checkpoints = bool(getattr(ns, "save", "") or getattr(ns, "load", ""))
    if ddp.optimizer.muon or (ddp.optimizer.optimizer == "sgd" and checkpoints):
        what = "SGD with --save / --load" if checkpoints else "Muon"
        raise CaptureError(
            f"--optimizer {ddp.optimizer.optimizer}: capture-megatron's trainer does not train "
            f"{what} (Muon needs NVIDIA's Emerging-Optimizers, which is not installed here; "
            "checkpoints are Adam's); `plan` and `predict` forecast its state and step "
            "(capture_megatron.features.optimizers), and Megatron-LM runs it with the plan's flags"
        )
    plan = parallel_plan(from_namespace(ParallelFlags, ns), shape, world_size, ddp)
    optim, data = from_namespace(OptimOptions, ns), data_options(ns)
    checkpoint, run = from_namespace(CheckpointOptions, ns), from_namespace(RunOptions, ns)
    build, kernels = from_namespace(BuildOptions, ns), from_namespace(Kernels, ns)
    problem = trainer_kernels_problem(kernels)
    if problem:
        raise CaptureError(problem)
    return TrainConfig(shape, plan, optim, data, checkpoint, run, build, kernels)
