"""Offload in the search space (pure Python): the optimizer offload fractions and the
fine-grained activation offloading module sets the planner tries, and a candidate's settings
with each (issue 31; the forecast: forecast.offload and the optimizer's host bytes; the cost:
steptime.parts and steptime.offload); and Megatron-FSDP's ZeRO-3, the other way to move bytes
off a GPU that the throughput search tries on candidates that do not fit (issue 51; the
forecast: forecast.fsdp; the cost: steptime.fsdp)."""

from __future__ import annotations

import functools
from dataclasses import replace

from capture_megatron.config import ModelShape, ParallelFlags, ParallelPlan
from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.kernels import Kernels
from capture_megatron.errors import CaptureError
from capture_megatron.features.activation_offload import OFFLOAD_SETS, ActivationOffload
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.rules.megatron import dtype_problems, fsdp_problems
from capture_megatron.rules.modelled import kernels_offload_problem

OFFLOAD_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The optimizer offload fractions the planner searches (issue 31: 0, 1/4, 1/2, 3/4, 1)."""


def fixed_optimizer(flags: ParallelFlags, ddp: DdpOptions) -> dict[str, tuple[bool, ...]]:
    """The distributed optimizer when the command line fixes it: given, or needed by the
    precision-aware optimizer and several optimizer instances (megatron-core's rule), or left out
    by an optimizer other than Adam (megatron-core's distributed optimizer is Adam's) and under
    Megatron-FSDP (which shards as its strategy says, whichever optimizer wraps it)."""
    needs = ddp.use_precision_aware_optimizer or ddp.num_distributed_optimizer_instances > 1
    if flags.use_distributed_optimizer or needs:
        return {"distributed_optimizer": (True,)}
    if ddp.optimizer.optimizer != "adam" or ddp.fsdp.enabled:  # Megatron-FSDP shards by itself
        return {"distributed_optimizer": (False,)}
    return {}


def fixed_offload(ddp: DdpOptions) -> tuple[float, ...]:
    """The offload fractions the command line fixed: --optimizer-cpu-offload's fraction (Megatron's
    default 1), or --optimizer-offload-fraction alone when not its default 1 (0: no offload; the
    fraction alone cannot be told from the default 1); empty: searched."""
    if ddp.optimizer_cpu_offload:
        return (ddp.optimizer_offload_fraction,)
    fraction = ddp.optimizer_offload_fraction
    return (fraction,) if fraction != 1.0 else ()


def searched_offload(
    ddp: DdpOptions, objective: str, gpu: bool, dtype: str, kernels: Kernels
) -> tuple[float, ...]:
    """The optimizer offload fractions searched when the command line fixed none: on GPUs
    OFFLOAD_FRACTIONS for min-gpus and throughput (which takes offload only where it is faster than
    every plan without it: plan.search), where Megatron-LM runs it with the settings given (the
    precision-aware optimizer's dtypes fp32, gradients not fp16, low-precision parameters only with
    a recipe Megatron-LM offloads: rules.modelled.kernels_offload_problem); no offload for min-peak
    and on CPU processes (whose device memory is the host's)."""
    if not gpu or objective == "min-peak":
        return (0.0,)
    try:
        moved = offload_ddp(ddp, 1.0)
    except CaptureError:
        return (0.0,)
    refused = dtype_problems(moved, dtype) or kernels_offload_problem(moved, kernels)
    return (0.0,) if refused else OFFLOAD_FRACTIONS


@functools.lru_cache(maxsize=1024)
def offload_ddp(ddp: DdpOptions, fraction: float) -> DdpOptions:
    """The settings of a candidate offloading `fraction` of its optimizer: as given when the
    command line turned offload on or the fraction is 0, else --optimizer-cpu-offload with the
    precision-aware optimizer (CaptureError when Megatron refuses that with the settings given)."""
    if ddp.optimizer_cpu_offload or fraction <= 0.0:
        return ddp
    return replace(
        ddp,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=fraction,
        use_precision_aware_optimizer=True,
    )


def activation_sets(
    shape: ModelShape, ddp: DdpOptions, objective: str, kind: str, kernels: Kernels
) -> tuple[tuple[str, ...], ...]:
    """The fine-grained activation offloading module sets searched when the command line turned
    none on: on the GPU kernel set with Transformer Engine (megatron-core hooks TE's cpu_offload)
    for min-gpus and throughput, no offload and OFFLOAD_SETS (the MoE set only for a model with
    experts); none for min-peak, on CPU processes and with low-precision compute (whose offloaded
    tensors the forecast has not been checked against)."""
    given = ddp.activation_offload.fine_grained_activation_offloading
    if given or objective == "min-peak" or not kind.startswith("gpu:transformer_engine"):
        return ((),)
    if kernels.low_precision:
        return ((),)
    sets = OFFLOAD_SETS if shape.moe.enabled else OFFLOAD_SETS[:-1]
    return ((), *sets)


@functools.lru_cache(maxsize=1024)
def activation_ddp(ddp: DdpOptions, modules: tuple[str, ...]) -> DdpOptions:
    """The settings of a candidate offloading the activations of `modules` (as given when
    empty)."""
    if not modules:
        return ddp
    return replace(ddp, activation_offload=ActivationOffload.of(modules))


def offloaded(plan: ParallelPlan) -> float:
    """The fraction of the plan's optimizer offloaded to the host (0 without offload)."""
    ddp = plan.ddp
    return ddp.optimizer_offload_fraction if ddp.optimizer_cpu_offload else 0.0


def activation_rank(ddp: DdpOptions) -> int:
    """How much of a layer's activations the settings offload: 0 without, else the position of
    their module set in OFFLOAD_SETS plus one (each set holds the one before; a set given on the
    command line that is none of them counts as the first)."""
    groups = ddp.activation_offload.groups
    if not groups:
        return 0
    return OFFLOAD_SETS.index(groups) + 1 if groups in OFFLOAD_SETS else 1


ZERO3 = Fsdp(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
"""The Megatron-FSDP settings the planner tries: ZeRO-3 (weights, gradients and optimizer state
sharded, each layer's weights gathered per micro-batch), Megatron-FSDP's other buffers at their
defaults."""


def searched_fsdp(ddp: DdpOptions, objective: str, gpu: bool, kernels: Kernels) -> tuple[bool, ...]:
    """Whether the search tries Megatron-FSDP twins (Space.fsdp) when the command line left it
    open: on GPUs for min-gpus and throughput, with Adam, where Megatron-LM runs ZeRO-3 with the
    settings given (not with 1-byte parameters, optimizer offload or the precision-aware
    optimizer, several optimizer instances or fine-grained activation offloading, none of which
    capture-megatron forecasts under it); never for min-peak and on CPU processes (Megatron-FSDP
    runs on CUDA only)."""
    if not gpu or objective == "min-peak" or ddp.fsdp.enabled:
        return (False,)
    settings = (
        ddp.use_precision_aware_optimizer,
        ddp.optimizer_cpu_offload,
        ddp.num_distributed_optimizer_instances > 1,
        bool(ddp.activation_offload.groups),
        kernels.low_precision_params,
        ddp.optimizer.optimizer != "adam",
    )
    return (False,) if any(settings) else (False, True)


@functools.lru_cache(maxsize=1024)
def fsdp_ddp(ddp: DdpOptions) -> DdpOptions:
    """The settings of a candidate's Megatron-FSDP twin (ZERO3)."""
    return replace(ddp, fsdp=ZERO3)


def fsdp_twin(plan: ParallelPlan) -> ParallelPlan | None:
    """`plan` under Megatron-FSDP's ZeRO-3 (fsdp_ddp), with the distributed optimizer as
    Megatron-LM's FSDP recipes give it; None where it shards nothing (one data x context-parallel
    rank), the plan offloads its optimizer or activations, or megatron-core refuses it with the
    plan's settings."""
    moved = offloaded(plan) or plan.ddp.activation_offload.groups  # not forecast together
    if plan.dp * plan.cp == 1 or plan.ddp.fsdp.enabled or moved:
        return None
    ddp = fsdp_ddp(plan.ddp)
    refused = fsdp_problems(
        ddp.fsdp,
        ddp.use_precision_aware_optimizer,
        ddp.optimizer_cpu_offload,
        ddp.num_distributed_optimizer_instances,
        plan.ep > 1,
    )
    if refused:
        return None
    try:
        return replace(plan, distributed_optimizer=True, ddp=ddp)
    except CaptureError:  # what megatron-core refuses of these settings with the plan's sizes
        return None
