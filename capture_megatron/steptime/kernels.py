"""The step-time model's primitives: what one GEMM, one pass over HBM and one collective take on
one GPU, the tokens a GPU holds, and the containers a layer's time is returned in (LayerTime with
its Parts: where the seconds go). Pure Python; every other piece of capture_megatron.steptime is
built from these.

A GEMM (m x k) @ (k x n) takes 2mnk / (peak x gemm_efficiency) plus its bytes (operands read,
result written) over HBM; the backward runs two GEMMs of the same size per forward GEMM (data and
weight gradients).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.steptime.constants import Constants
from capture_megatron.steptime.hardware import Hardware
from capture_megatron.steptime.settings import StepSettings


@dataclass(frozen=True)
class Setting:
    """Everything a piece of the step's time depends on besides the model and the plan."""

    hw: Hardware
    """The accelerator and its links."""
    run: StepSettings
    """Overlap and precision settings of the run."""
    k: Constants
    """The model's fitted constants."""


@dataclass(frozen=True)
class Parts:
    """Seconds of a piece of a step by where they go (forward and backward together, or one of
    them where a field says so); what the step breakdown (capture_megatron.steptime.breakdown)
    adds up."""

    compute: float = 0.0
    """GEMMs, the attention core, memory-bound kernels (norms, activations, the loss)."""
    tp: float = 0.0
    """Tensor-parallel collectives left exposed (sequence-parallel gathers and scatters,
    all-reduces; the expert tensor-parallel ones of the MoE block)."""
    cp: float = 0.0
    """Context parallelism's K/V exchange left exposed."""
    ep: float = 0.0
    """MoE dispatch and combine communication (all-to-all, all-gather, DeepEP / HybridEP) left
    exposed."""
    dispatch: float = 0.0
    """MoE dispatch work besides the communication: router, permute and unpermute passes."""
    dp: float = 0.0
    """Data-parallel collectives left exposed (Megatron-FSDP's per-layer gathers and
    reduce-scatters here; the step's gradient reduce and parameter gather in the breakdown)."""
    recompute: float = 0.0
    """Forward work re-run in the backward (full or selective recompute)."""
    offload: float = 0.0
    """Host transfers of fine-grained activation offloading that compute does not hide."""
    overhead: float = 0.0
    """Per-pass schedule overhead (chunk_overhead) and host time launches do not hide."""

    @property
    def total(self) -> float:
        """Every part together."""
        return sum(_VALUES(self))

    def __add__(self, other: Parts) -> Parts:
        return Parts(*map(operator.add, _VALUES(self), _VALUES(other)))

    def scaled(self, factor: float) -> Parts:
        """Every part times `factor`."""
        return Parts(*(x * factor for x in _VALUES(self)))


_VALUES = operator.attrgetter(*(f.name for f in fields(Parts)))
"""A Parts' values in field order (a step's time adds up millions of them)."""


@dataclass(frozen=True)
class LayerTime:
    """Seconds one transformer layer takes on one GPU for one micro-batch."""

    forward: float
    """Forward: compute plus the communication left exposed."""
    backward: float
    """Backward: compute plus the communication left exposed."""
    recomputed_forward: float
    """The forward of the modules selective recompute re-runs in the backward (--recompute-modules;
    its default: the attention core); 0 without selective recompute."""
    parts: Parts = Parts()
    """forward + backward by where the seconds go (the recomputed forward apart)."""


def gemm(s: Setting, m: float, n: float, k: float) -> float:
    """Seconds of one bf16 GEMM (m x k) @ (k x n) on one GPU."""
    flops = 2 * m * n * k / (s.hw.peak_flops * s.k.gemm_efficiency)
    return flops + 2 * (m * k + k * n + m * n) / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)


def hbm(s: Setting, nbytes: float) -> float:
    """Seconds of a memory-bound pass moving `nbytes` through HBM."""
    return nbytes / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)


def tokens(shape: ModelShape, plan: ParallelPlan) -> float:
    """Tokens one GPU processes per micro-batch (its 1 / CP share of the sequence)."""
    return plan.micro_batch_size * shape.seq_length / plan.cp


def sequence_tokens(shape: ModelShape, plan: ParallelPlan) -> float:
    """Tokens of the hidden states one GPU holds per micro-batch: 1 / TP of `tokens` with
    sequence parallelism."""
    return tokens(shape, plan) / (plan.tp if plan.sequence_parallel else 1)


def ring(s: Setting, nbytes: float, ranks: int, bandwidth: float, passes: float = 1.0) -> float:
    """Seconds of a ring collective moving `nbytes` (the whole tensor) among `ranks`: passes 1 for
    an all-gather or reduce-scatter, 2 for an all-reduce."""
    if ranks <= 1:
        return 0.0
    return passes * (ranks - 1) / ranks * nbytes / (bandwidth * s.k.link_efficiency)
