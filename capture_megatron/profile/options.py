"""ProfileOptions: what `profile()` measures and how (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.errors import require
from capture_megatron.records import Variant

DEVICES = ("cpu", "cuda", "fake")
"""Where probes run: real CPU tensors, a CUDA GPU, or FakeTensorMode on the host."""


@dataclass(frozen=True)
class ProfileOptions:
    """What to profile for a model, and on which device."""

    device: str = "cpu"
    """cpu, cuda or fake (FakeTensorMode: no data, no compute, any size)."""
    transformer_impl: str = "auto"
    """local, transformer_engine or auto (cuda only; cpu and fake use the local spec)."""
    tps: tuple[int, ...] = (1,)
    """TP sizes of the model's own (anchor) probes."""
    micro_batch_sizes: tuple[int, ...] = (1,)
    """Micro-batch sizes of the anchor probes."""
    variants: tuple[Variant, ...] = ()
    """Recompute / sequence-parallel variants to probe; empty: the model without either."""
    design: bool = True
    """Also probe the design shapes on which every regression term is identifiable."""
    timelines: bool = True
    """Record allocation timelines (cpu and fake), from which fit replays transient peaks."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        p = []
        if self.device not in DEVICES:
            p.append(f"--device {self.device!r} is not one of {', '.join(DEVICES)}")
        for name, values in (("TP sizes", self.tps), ("micro-batch sizes", self.micro_batch_sizes)):
            if not values or min(values) < 1:
                p.append(f"{name} {list(values)} must be positive integers")
        require(p, "profile options")
