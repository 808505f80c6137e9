"""What optimizer CPU offload (--optimizer-cpu-offload) costs in the step-time model, and the note
predict and plan print about it ("offloading 1/2 of the optimizer: -X GiB, +Y s/step"). Pure
Python.

HybridDeviceOptimizer's step (megatron-core 0.16.1 optimizer/cpu_offloading/hybrid_optimizer.py
`step`): the moved slices' gradients are copied to the host (D2H, the gradient buffer's dtype), the
device-side Adam runs on the kept slices, each host AdamW runs once its gradients have arrived, and
its step hook copies the updated slice back into the parameter buffer (H2D, the parameter dtype).
Without --overlap-cpu-optimizer-d2h-h2d all of it runs on the current stream, one after the other;
with it the copies run on their own streams, one host optimizer per slice, so the transfers and the
host Adam overlap (the longer of the two counts).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.features.optimizer_offload import HOST_BYTES
from capture_megatron.forecast.static import layout_of
from capture_megatron.steptime.hardware import Hardware

HOST_ADAM_BYTES = 28
"""Host-memory bytes torch's AdamW moves per element: fp32 parameter, gradient and both moments
read, parameter and moments written."""
HOST_ADAM_BYTES_PER_S = 20e9
"""Host-memory bytes per second of one rank's host AdamW, from the one published measurement of
HybridDeviceOptimizer found (NVIDIA-NeMo/RL pull request 3628: Qwen3-0.6B, ~0.6e9 parameters, on
one H100 -- 0.752 s per step without offload, 1.187 s with half offloaded and no overlap, 1.678 s
with all of it and overlap): about 1.5 ns per moved element, of which the host link takes 0.1.
A single rank owned the node's CPU there; ranks sharing a node's CPU are not modelled (the
estimate is then optimistic)."""


def device_share(plan: ParallelPlan) -> float:
    """The fraction of a rank's optimizer elements updated on the device."""
    ddp = plan.ddp
    return 1.0 - ddp.optimizer_offload_fraction if ddp.optimizer_cpu_offload else 1.0


def host_step_seconds(shape: ModelShape, plan: ParallelPlan, hw: Hardware, owned: float) -> float:
    """Seconds the host side of the step adds for a rank owning `owned` optimizer elements: the
    moved slices' gradients down and parameters up over the host link, and the host AdamW."""
    ddp = plan.ddp
    if not ddp.optimizer_cpu_offload:
        return 0.0
    moved = owned * ddp.optimizer_offload_fraction
    per_element = dtype_bytes(ddp.grad_dtype(shape.dtype)) + dtype_bytes(shape.dtype)
    transfer = moved * per_element / hw.host_bytes_per_s
    adam = moved * HOST_ADAM_BYTES / HOST_ADAM_BYTES_PER_S
    return max(transfer, adam) if ddp.overlap_cpu_optimizer_d2h_h2d else transfer + adam


def without_offload(plan: ParallelPlan) -> ParallelPlan:
    """The same plan with the optimizer kept on the device."""
    return dataclasses.replace(plan, ddp=dataclasses.replace(plan.ddp, optimizer_cpu_offload=False))


def fraction_words(fraction: float) -> str:
    """none, 1/2, 3/4, all, or the fraction as given."""
    if fraction >= 1.0:
        return "all"
    if fraction <= 0.0:
        return "none"
    f = Fraction(fraction).limit_denominator(16)
    return f"{f.numerator}/{f.denominator}" if float(f) == fraction else f"{fraction:g}"


def state_saved(dtype: str, plan: ParallelPlan, optimizer: float, host: float) -> float:
    """Device bytes of optimizer state a rank keeps less than without offload, from its
    forecast optimizer bytes (the kept elements') and host bytes (the moved ones'): without
    offload the precision-aware optimizer keeps every element at its own bytes."""
    kept_state = layout_of(dtype, plan.ddp, 1, True).state
    before = layout_of(dtype, without_offload(plan).ddp, 1, True).state
    elements = optimizer / kept_state + host / HOST_BYTES
    return elements * before - optimizer


def offload_note(plan: ParallelPlan, host: float, saved: float, seconds: float | None) -> str:
    """The note on a plan with --optimizer-cpu-offload: the device bytes saved on a rank, its
    host bytes, and the step seconds added (None: not estimated, CPU processes)."""
    words = fraction_words(plan.ddp.optimizer_offload_fraction)
    slower = f", {seconds:+.3f} s/step" if seconds is not None else ""
    # at fraction 0 HybridDeviceOptimizer keeps more on the device than the optimizer without it
    change = f"-{_size(saved)}" if saved >= 0 else f"+{_size(-saved)}"
    return (
        f"offloading {words} of the optimizer: {change} of optimizer state on the "
        f"device{slower}, {_size(host)} of host memory per rank ({HOST_BYTES} bytes per "
        "moved element: fp32 copy, moments, gradient; the CPU Adam's speed is an assumption, "
        "capture_megatron.steptime.offload)"
    )


def _size(nbytes: float) -> str:
    """GiB, or MiB below one GiB."""
    if nbytes >= 2.0**30:
        return f"{nbytes / 2.0**30:.2f} GiB"
    return f"{nbytes / 2.0**20:.2f} MiB"
