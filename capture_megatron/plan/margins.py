"""What a GPU must hold beyond a plan's predicted peak of allocated bytes: the caching allocator's
reserve and the memory outside the allocator, each a separate term with its measured source
(docs/MEMORY_MODEL.md, Margins). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import GIB

RESERVE_FRACTION = 0.02
"""Default allocator reserve: reserved was 1.9% above allocated on a dense Megatron-LM run on H100
(../shared/GPU_FIDELITY.md, section 8), rounded up. MoE runs show 13-26% (Megatron's offloading
docs); MoE is not modelled."""
CONTEXT_GIB = 3.9
"""Default memory per process outside the allocator (CUDA context, NCCL), GiB: the upper bound
measured on the same run (GPU_FIDELITY.md, section 8; taken during a checkpoint save)."""


@dataclass(frozen=True)
class Margins:
    """What a GPU must hold beyond a plan's predicted peak of allocated bytes."""

    reserve_fraction: float = RESERVE_FRACTION
    """CUDA: the caching allocator's reserve above allocated, as a fraction of the peak."""
    context_bytes: float = CONTEXT_GIB * GIB
    """CUDA: the CUDA context and NCCL, outside the allocator."""
    calibration: float = 1.0
    """Measured / predicted peak of verified runs on this device (`verify --refit`)."""
    on_cpu: bool = False
    """CPU processes: no allocator reserve and no CUDA context."""

    def needed(self, peak: float) -> float:
        """Bytes a GPU must have for a predicted peak."""
        peak = peak * self.calibration
        return peak if self.on_cpu else peak * (1 + self.reserve_fraction) + self.context_bytes
