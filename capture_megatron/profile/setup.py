"""What a profiling session measures with (`Setup`): the one type that profile/session.py, which
makes it, and profile/probe.py, which builds and measures each probe with it, both need. A module of
its own so that neither imports the other (session runs probe; probe only reads a Setup)."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import Kernels
from capture_megatron.profile.options import FAKE_DEVICES


@dataclass(frozen=True)
class Setup:
    """What a profiling session measures with."""

    device: str
    """cpu, fake-cpu, fake-cuda or cuda."""
    kernels: Kernels | None
    """The GPU kernels the probes are built with (None: the local spec on CPU kernels)."""
    kernel_set: str
    """Its name (capture_megatron.config.kernels.kernel_set), recorded with every probe."""
    versions: tuple[str, str, str]
    """(capture-megatron, torch, megatron-core)."""

    @property
    def fake(self) -> bool:
        """Whether probes run under FakeTensorMode."""
        return self.device in FAKE_DEVICES

    @property
    def tensor_device(self) -> str:
        """Where the probes' own tensors (batch, received activations) live."""
        return "cuda" if self.device in ("cuda", "fake-cuda") else "cpu"
