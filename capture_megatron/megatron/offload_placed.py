"""What megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload) placed on this rank: the
bytes its device-side and host-side sub-optimizers keep, counted tensor by tensor after a step
(capture_megatron.features.optimizer_offload says what the forecast expects of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer


@dataclass(frozen=True)
class OffloadPlaced:
    """Bytes one rank's HybridDeviceOptimizers keep (0, 0 without optimizer offload)."""

    device: int
    """Device side: the fp32 master copies of 16-bit slices it keeps there, their moments, and
    the fp32 gradient copies of those whose gradient is 16-bit."""
    host: int
    """Host side: the moved slices' fp32 copies, moments, step tensors and gradient copies."""


def _bytes(t: object) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """The optimizer's state tensors, less its parameters themselves: HybridDeviceOptimizer's
    _sync_sub_optimizers_state_to_hdo files each sub-optimizer parameter in its own state dict as
    'master_param' (the same tensor)."""
    return sum(_bytes(v) for p, state in opt.state.items() for v in state.values() if v is not p)


def _hybrid(optimizer: MegatronOptimizer) -> list[HybridDeviceOptimizer]:
    """The HybridDeviceOptimizers inside megatron's (chained) distributed optimizer."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    found = [getattr(o, "optimizer", None) for o in inner]
    return [h for h in found if isinstance(h, HybridDeviceOptimizer)]


def placed(optimizer: MegatronOptimizer) -> OffloadPlaced:
    """Count what each HybridDeviceOptimizer of `optimizer` keeps on either side."""
    device = host = 0
    for hdo in _hybrid(optimizer):
        for cpu in hdo.cpu_optimizers:
            for group in cpu.param_groups:
                for p in group["params"]:
                    host += _bytes(p) + _bytes(hdo.cpu_copy_map_grad.get(p))
            host += _state_bytes(cpu)
        gpu = hdo.gpu_optimizer
        if gpu is None:
            continue
        masters = {id(t) for t in hdo.param_to_fp32_param.values()}
        for group in gpu.param_groups:
            for p in group["params"]:
                if id(p) in masters:  # a copy; fp32 slices are views of the param buffer
                    grad = p.grad
                    orig = hdo.fp32_param_to_orig_param[p]
                    source = getattr(orig, "decoupled_grad", orig.grad)
                    copied = grad is not None and source is not None and grad is not source
                    device += _bytes(p) + (_bytes(grad) if copied else 0)
        device += _state_bytes(gpu)
    return OffloadPlaced(device, host)
