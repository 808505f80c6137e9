"""Backend: what a rank's layers are built from, chosen once by the caller (the trainer, a probe
session) and passed to the builder, instead of read from the device the patches were applied for.
Pure Python apart from Kernels (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import Kernels
from capture_megatron.config.kernels import TE_FUSED_BACKENDS

KINDS = ("cpu", "gpu", "emulated-gpu")
"""cpu: megatron-core's local spec on the CPU kernel set (cpu and fake-cpu devices); gpu: a real
CUDA device, Transformer Engine's spec or the local spec as the kernels say; emulated-gpu: the GPU
kernel set's modules (megatron/gpu_spec.py, emulate/gpu/) on the fake CUDA device."""


@dataclass(frozen=True)
class Backend:
    """The layer implementation a model is built with."""

    kind: str = "cpu"
    """One of KINDS."""
    kernels: Kernels | None = None
    """The GPU kernels (transformer_impl resolved); None on the CPU kernel set."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"backend {self.kind!r} not one of {KINDS}")
        if (self.kernels is None) != (self.kind == "cpu"):
            raise ValueError(f"backend {self.kind!r}: GPU kernels go with the GPU kinds only")

    @classmethod
    def of(cls, device: str, kernels: Kernels | None) -> Backend:
        """The backend of a run on `device` (cpu, fake-cpu, fake-cuda, cuda) with `kernels`
        (None: the CPU kernel set, whatever the device)."""
        if kernels is None:
            return cls()
        return cls("emulated-gpu" if device == "fake-cuda" else "gpu", kernels)

    @property
    def emulated(self) -> bool:
        """The GPU kernel set on fake CUDA."""
        return self.kind == "emulated-gpu"

    @property
    def real_te(self) -> bool:
        """Built from Transformer Engine's own modules (a real GPU with TE)."""
        return self.kind == "gpu" and self._te

    @property
    def te_attention(self) -> bool:
        """The core attention is Transformer Engine's flash or fused one, real or the GPU kernel
        set's (both run context parallelism themselves)."""
        if self.emulated:
            assert self.kernels is not None
            return self._te and self.kernels.attention_backend in TE_FUSED_BACKENDS
        return self.real_te

    @property
    def _te(self) -> bool:
        return self.kernels is not None and self.kernels.transformer_impl == "transformer_engine"
