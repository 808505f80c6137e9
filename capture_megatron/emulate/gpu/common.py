"""Helpers of the GPU kernel modules, and the interface a linear layer's numeric precision
offers them (Precision)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value (the range TE scales its 1-byte E4M3 tensors to)."""
HELD = "held_state"
"""The attribute under which an emulated module keeps, as a plain list (no buffer, never in a
state dict), the tensors it holds for good besides its parameters: a low-precision recipe's
weight copies and scaling state (capture_megatron.profile.held.low_precision_state_bytes)."""


def is_fake(*tensors: torch.Tensor) -> bool:
    """Whether any tensor is a FakeTensorMode tensor (no data: only allocate, never compute)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) for t in tensors)


class Precision:
    """How the GPU kernel set's linear layers compute: this base class, in the activation dtype
    (nothing kept beyond what the bf16 path keeps); a low-precision recipe's emulation subclasses
    it (megatron/gpu_spec.py chooses it from the run's Kernels)."""

    def keep_weights(self, module: torch.nn.Module, weights: list[torch.Tensor]) -> None:
        """Allocate, once per module, what the layer keeps for its weights beyond them (under
        HELD); nothing in the activation dtype."""

    @contextlib.contextmanager
    def saving(self, inputs: list[torch.Tensor], gathered: bool) -> Iterator[None]:
        """Inside, autograd saves the layer's `inputs` as the precision keeps them (`gathered`:
        the layer all-gathers them in backward); as they are in the activation dtype."""
        yield


FULL = Precision()
"""The activation dtype's Precision."""
