"""ProfileOptions: what `profile()` measures and how (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import Kernels
from capture_megatron.errors import CaptureError, require
from capture_megatron.records import Variant

DEVICES = ("cpu", "fake-cpu", "fake-cuda", "cuda")
"""Where probes run: real CPU tensors; FakeTensorMode with CPU kernels; FakeTensorMode on fake
CUDA tensors with the GPU kernels (capture_megatron.emulate.fake_cuda); a real CUDA GPU."""
ALIASES = {"fake": "fake-cuda"}
"""Other accepted names of devices."""
FAKE_DEVICES = ("fake-cpu", "fake-cuda")
"""The devices that run under FakeTensorMode (no data, no compute, any size)."""


def device_name(requested: str) -> str:
    """The device a --device value names; CaptureError for an unknown one."""
    name = ALIASES.get(requested, requested)
    if name not in DEVICES:
        known = ", ".join(DEVICES + tuple(f"{a} (= {b})" for a, b in ALIASES.items()))
        raise CaptureError(f"--device {requested!r} is not one of {known}")
    return name


@dataclass(frozen=True)
class ProfileOptions:
    """What to profile for a model, and on which device."""

    device: str = "cpu"
    """cpu, fake-cpu, fake-cuda (alias fake) or cuda."""
    kernels: Kernels = Kernels()
    """The GPU kernels to profile (fake-cuda and cuda; cpu and fake-cpu run the local spec on
    CPU kernels)."""
    tps: tuple[int, ...] = (1,)
    """TP sizes of the model's own (anchor) probes."""
    micro_batch_sizes: tuple[int, ...] = (1,)
    """Micro-batch sizes of the anchor probes."""
    variants: tuple[Variant, ...] = ()
    """Recompute / sequence-parallel variants to probe; empty: the model without either."""
    design: bool = True
    """Also probe the design shapes on which every regression term is identifiable."""
    timelines: bool = True
    """Record allocation timelines (not on cuda), from which fit replays transient peaks."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        p = []
        if ALIASES.get(self.device, self.device) not in DEVICES:
            p.append(f"--device {self.device!r} is not one of {', '.join(DEVICES)}")
        for name, values in (("TP sizes", self.tps), ("micro-batch sizes", self.micro_batch_sizes)):
            if not values or min(values) < 1:
                p.append(f"{name} {list(values)} must be positive integers")
        require(p, "profile options")
