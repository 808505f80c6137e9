"""The step-time model's constants: fitted by bench/step_time.py to published H100 step times
(the development set, bench/data/step_times_h100_dev.json) and shipped as package data
(constants.json, with their provenance). Pure Python."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields
from importlib import resources

from capture_megatron.errors import require
from capture_megatron.serial import JsonMixin, from_plain

CONSTANTS_FILE = "constants.json"
"""The fitted constants, package data of capture_megatron.planner."""
FITTED = (
    "gemm_efficiency",
    "attention_efficiency",
    "elementwise_passes",
    "tp_overlap_exposed",
    "dp_overlap_exposed",
    "chunk_overhead",
    "all_to_all_efficiency",
)
"""The constants bench/step_time.py fits; the others are set from first principles."""


@dataclass(frozen=True)
class Constants(JsonMixin):
    """The step-time model's constants (capture_megatron.steptime.parts uses them)."""

    gemm_efficiency: float = 0.75
    """Fraction of peak FLOP/s a large bf16 GEMM reaches (its bytes over HBM come on top)."""
    attention_efficiency: float = 0.5
    """Fraction of peak FLOP/s flash / cuDNN fused attention reaches on the causal half of the
    s x s work."""
    elementwise_passes: float = 12.0
    """Reads and writes of each hidden-size activation per layer forward by the memory-bound
    kernels (norms, RoPE, dropout, residual adds)."""
    tp_overlap_exposed: float = 0.3
    """Fraction of the TP collectives' time left exposed under --tp-comm-overlap."""
    dp_overlap_exposed: float = 0.1
    """Fraction of an overlapped data-parallel reduce / gather always left exposed (the last
    bucket); the rest is hidden up to the backward (forward) compute it overlaps."""
    chunk_overhead: float = 1e-3
    """Seconds each forward or backward of one micro-batch through one model chunk costs beyond
    its kernels (the schedule's host work, launches, pipeline bookkeeping)."""
    all_to_all_efficiency: float = 0.8
    """Fraction of a GPU's link bandwidth (its NIC across NVLink domains, NVLink inside one) the
    MoE all-to-all dispatch and combine reach (NCCL's all-to-all of the alltoall dispatcher;
    its prior: the ring collectives' link_efficiency)."""
    link_efficiency: float = 0.8
    """Fraction of link bandwidth NCCL's ring collectives reach (nccl-tests bus bandwidth on
    NVLink and InfiniBand; not fitted)."""
    memory_efficiency: float = 0.8
    """Fraction of HBM bandwidth streaming kernels reach (not fitted)."""
    deterministic_backward: float = 1.25
    """Slow-down of the attention backward under --deterministic-mode (not fitted)."""
    flex_efficiency: float = 0.9
    """Fraction of the link bandwidth DeepEP / HybridEP's dispatch and combine reach (not fitted:
    DeepEP's published normal-kernel bandwidths, 153-158 GB/s of H800's ~160 GB/s NVLink and
    43-58 GB/s of a 50 GB/s CX7 NIC, docs/legacy.md of deepseek-ai/DeepEP)."""
    dispatch_latency: float = 50e-6
    """Seconds each MoE dispatch or combine costs beyond its bytes (the collective's latency over
    the EP group, the dispatcher's host work; not fitted: no development row resolves it)."""
    grouped_gemm_tile: float = 128.0
    """Rows of the grouped GEMM's tile: each expert's tokens are computed in whole tiles, so few
    tokens per expert waste the rest (not fitted: the M tile of the Hopper grouped GEMM
    kernels)."""
    launch_seconds: float = 8e-6
    """Host seconds to launch one kernel in eager mode (PyTorch's dispatcher and the CUDA launch);
    a layer whose kernels take less than their launches waits on the host, which CUDA graphs
    remove (capture_megatron.steptime.launch; not fitted: no development row is host-bound)."""
    provenance: str = "defaults (not fitted)"
    """Where the values come from: the fit's data set, its rows and errors, the date."""

    def __post_init__(self) -> None:
        p = [
            f"{f.name} {getattr(self, f.name)!r} must be a positive number"
            for f in fields(self)
            if f.name != "provenance"
            and not (math.isfinite(getattr(self, f.name)) and getattr(self, f.name) > 0)
        ]
        require(p, "step-time constants")


@functools.cache
def fitted() -> Constants:
    """The shipped constants (bench/step_time.py writes them; package data, tested to be in the
    wheel)."""
    path = resources.files("capture_megatron.steptime").joinpath(CONSTANTS_FILE)
    return from_plain(Constants, json.loads(path.read_text())["constants"])
