"""Helpers of the GPU kernel modules."""

from __future__ import annotations

import torch


def is_fake(*tensors: torch.Tensor) -> bool:
    """Whether any tensor is a FakeTensorMode tensor (no data: only allocate, never compute)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) for t in tensors)
