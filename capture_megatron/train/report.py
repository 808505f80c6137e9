"""MemoryReport: what a training run measured, per rank and per iteration (the JSON that
`--memory-report` writes and `capture-megatron verify` reads)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.serial import OMIT_DEFAULT, JsonMixin, from_plain, to_plain


@dataclass(frozen=True)
class RankMemory(JsonMixin):
    """One process's measured memory."""

    rank: int
    """Global rank."""
    tp_rank: int
    """Tensor-parallel rank."""
    pp_rank: int
    """Pipeline rank."""
    dp_rank: int
    """Data-parallel rank."""
    peak_bytes: int
    """Peak allocated tensor bytes during the training iterations (CUDA: max_memory_allocated; CPU:
    exact live-tensor accounting). Setup transients (weight init, checkpoint loading) are
    excluded."""
    layers: tuple[int, ...]
    """Global (1-based) numbers of the transformer layers this rank holds."""
    setup_bytes: int
    """Live bytes when training starts (params, grad buffers, Megatron's buffers; no optimizer state
    yet)."""
    reserved_bytes: int = 0
    """CUDA only: peak bytes the caching allocator reserved (allocated + its reserve); 0 on CPU."""
    cp_rank: int = 0
    """Context-parallel rank (0 without context parallelism, and in reports written before it)."""
    ep_rank: int = 0
    """Expert-parallel rank (which slice of the routed experts this rank holds; 0 without EP)."""
    optimizer_device_bytes: int = field(default=0, metadata={OMIT_DEFAULT: True})
    """--optimizer-cpu-offload: bytes HybridDeviceOptimizer's device-side optimizer keeps (fp32
    masters of 16-bit slices, moments, fp32 gradient copies), counted at the end of training."""
    optimizer_host_bytes: int = field(default=0, metadata={OMIT_DEFAULT: True})
    """--optimizer-cpu-offload: bytes its host-side optimizers keep (fp32 copies, moments, step
    tensors, gradient copies)."""


@dataclass(frozen=True)
class IterationStats(JsonMixin):
    """One optimizer step as seen by the last pipeline stage."""

    iteration: int
    """1-based iteration number (continues after a resume)."""
    loss: float
    """Mean LM loss over the global batch's tokens."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used."""
    step_seconds: float
    """Wall time of the step."""
    tokens_per_second: float
    """Global batch tokens / step_seconds."""


@dataclass(frozen=True)
class MemoryReport(JsonMixin):
    """The measured side of a run: per-rank peaks and per-iteration statistics."""

    device: str
    """cpu or cuda."""
    transformer_impl: str
    """local (Megatron's local spec) or transformer_engine."""
    shape: ModelShape
    """The model trained."""
    plan: ParallelPlan
    """The parallel plan trained (layout, recompute, batch)."""
    ranks: tuple[RankMemory, ...]
    """One entry per process, ordered by global rank."""
    iterations: tuple[IterationStats, ...]
    """Iterations run by this invocation."""

    def stage_peaks(self) -> tuple[int, ...]:
        """Per pipeline rank, the maximum measured peak over its TP/DP peers."""
        out = [0] * self.plan.pp
        for r in self.ranks:
            out[r.pp_rank] = max(out[r.pp_rank], r.peak_bytes)
        return tuple(out)

    def write(self, path: str) -> None:
        """Write the report as indented JSON."""
        with open(path, "w") as f:
            json.dump(to_plain(self), f, indent=1)

    @classmethod
    def read(cls, path: str) -> MemoryReport:
        """Read a report written by write()."""
        with open(path) as f:
            return from_plain(cls, json.load(f))
