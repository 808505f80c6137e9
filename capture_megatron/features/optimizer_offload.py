"""Megatron-LM's optimizer CPU offload (`--optimizer-cpu-offload`, core_v0.16.1): its rules and
how megatron-core's HybridDeviceOptimizer splits a rank's optimizer between device and host.
Pure Python: no torch import here.

megatron-core 0.16.1 (optimizer/__init__.py:306-347) builds, for `--optimizer-cpu-offload`, a
HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py) over the parameter slices the
distributed optimizer gives it (distrib_optimizer.py:602-605: the rank's shard views of the param
buffer, per parameter group fp32 ones then 16-bit ones), always with `param_update_in_fp32=True`,
torch's AdamW on the host and the device Adam on the GPU, both with fp32 moments:

- `_get_sub_optimizer_param_groups` walks the slices in that order and moves a slice to the host
  while the elements moved so far are below `fraction x` the rank's elements: whole slices, the
  last one crossing the threshold included (so between fraction x E and that plus one slice);
- a moved slice keeps on the host an fp32 copy (the pinned clone, made fp32 for 16-bit
  parameters), Adam's two fp32 moments and a 4-byte step tensor (torch's AdamW), and, from the
  first step, a pinned fp32 gradient copy (`cpu_copy_map_grad`, the parameter's dtype): 16 bytes
  per element; on the device it keeps nothing beyond its place in the param and grad buffers;
- a slice left on the device gets an fp32 master copy when it is 16-bit and Adam's two fp32
  moments (12 bytes, 8 for fp32 parameters), and at the step `grad.to(float32)` of its gradient,
  a copy (kept as the master's .grad) only when the gradient buffer is not fp32.
The precision-aware optimizer's --main-params-dtype / --exp-avg-dtype / --exp-avg-sq-dtype are not
passed to it (the states are fp32 whatever they say).
"""

from __future__ import annotations

import math
from typing import Protocol


class OffloadSettings(Protocol):
    """What the offload rules read of DdpOptions (described here, not imported: DdpOptions runs
    these rules when it is constructed)."""

    @property
    def optimizer_cpu_offload(self) -> bool:
        """--optimizer-cpu-offload."""

    @property
    def optimizer_offload_fraction(self) -> float:
        """--optimizer-offload-fraction."""

    @property
    def use_precision_aware_optimizer(self) -> bool:
        """--use-precision-aware-optimizer."""

    @property
    def main_params_dtype(self) -> str:
        """--main-params-dtype."""

    @property
    def exp_avg_dtype(self) -> str:
        """--exp-avg-dtype."""

    @property
    def exp_avg_sq_dtype(self) -> str:
        """--exp-avg-sq-dtype."""


HOST_BYTES = 16
"""Host bytes per offloaded element: fp32 parameter copy, two fp32 moments, pinned fp32 gradient."""
HOST_STEP_BYTES = 4
"""Host bytes per offloaded slice: torch AdamW's fp32 step tensor."""

_ARGS = "Megatron-LM core_v0.16.1 megatron/training/arguments.py"


def offload_problems(ddp: OffloadSettings) -> list[str]:
    """What Megatron-LM refuses (or would silently not do) in these offload settings."""
    p = []
    f = ddp.optimizer_offload_fraction
    if not 0.0 <= f <= 1.0 or math.isnan(f):
        p.append(
            f"--optimizer-offload-fraction {f} is outside [0, 1]: {_ARGS}:2061 reads it unchecked, "
            "and HybridDeviceOptimizer (cpu_offloading/hybrid_optimizer.py:258, offload_threshold "
            "= elements x fraction) then offloads everything above 1, as 1 does, and nothing below "
            "0, as 0 does; give the fraction meant"
        )
    if not ddp.optimizer_cpu_offload:
        return p
    if not ddp.use_precision_aware_optimizer:
        p.append(
            f"--optimizer-cpu-offload needs --use-precision-aware-optimizer ({_ARGS}:1190-1194: "
            "'The optimizer cpu offload must be used in conjunction with "
            "`--use-precision-aware-optimizer`, as the hybrid device optimizer reuses the code "
            "path of this flag')"
        )
    lowered = [
        f"--{name.replace('_', '-')} {getattr(ddp, name)}"
        for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if getattr(ddp, name) != "fp32"
    ]
    if lowered:
        p.append(
            f"{', '.join(lowered)} with --optimizer-cpu-offload: megatron-core 0.16.1 builds "
            "HybridDeviceOptimizer without them (optimizer/__init__.py:336-347, "
            "param_update_in_fp32=True), so its master weights and moments stay fp32 on both "
            "sides; leave them at fp32"
        )
    return p


def offloaded(fraction: float, elements: int) -> int:
    """Elements of a rank's `elements` optimizer elements HybridDeviceOptimizer moves to the host:
    at least ceil(fraction x elements) (the whole slice that crosses the threshold adds up to one
    slice more, which the forecast does not place: it does not replay the parameter groups'
    order)."""
    return min(elements, math.ceil(fraction * elements))


def offloaded_slices(fraction: float, tensors: int) -> int:
    """Parameter slices moved to the host, counted as the same fraction of the rank's slices."""
    return min(tensors, math.ceil(fraction * tensors))
