"""What probes of mixture-of-experts chunks need beyond dense ones: the fake job's size, which
parameters are routed experts', and what is not profiled yet."""

from __future__ import annotations

from capture_megatron.config import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.records import Probe


def probe_world(probe: Probe) -> tuple[int, int, int]:
    """(dp, ep, etp) of the fake job a probe runs in: its DP, raised to the least multiple for
    which EP x ETP divides TP x DP."""
    moe, tp, dp = probe.variant.moe, probe.shape.tp, probe.dp
    if moe is None:
        return dp, 1, tp
    while (tp * dp) % (moe.ep * moe.etp):
        dp += probe.dp
    return dp, moe.ep, moe.etp


def expert_mask(model) -> tuple[bool, ...]:
    """Per parameter, whether it is a routed expert's (megatron marks them allreduce=False); empty
    when none is."""
    mask = tuple(not getattr(p, "allreduce", True) for p in model.parameters())
    return mask if any(mask) else ()


def refuse_fake_cuda_experts(shape: ModelShape, device: str) -> None:
    """CaptureError for MoE layers on the fake CUDA device (not emulated yet)."""
    if shape.moe.enabled and device == "fake-cuda":
        raise CaptureError(
            "mixture-of-experts layers are not modelled on the fake CUDA device yet (the GPU "
            "kernel set's MoE modules are not emulated); forecast them for the CPU kernel set "
            "(--device cpu) or profile on a GPU"
        )
