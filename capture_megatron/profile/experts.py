"""What probes of mixture-of-experts chunks need beyond dense ones: the fake job's size, which
parameters are routed experts', and what is not profiled yet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from capture_megatron.records import Probe, Variant

if TYPE_CHECKING:
    import torch


def probe_world(probe: Probe) -> tuple[int, int, int, int]:
    """(dp, ep, etp, cp) of the fake job a probe runs in: its DP, raised to the least multiple for
    which EP x ETP divides TP x CP x DP."""
    moe, tp, dp, cp = probe.variant.moe, probe.shape.tp, probe.dp, probe.variant.cp
    if moe is None:
        return dp, 1, tp, cp
    while (tp * cp * dp) % (moe.ep * moe.etp):
        dp += probe.dp
    return dp, moe.ep, moe.etp, cp


def expert_mask(model: torch.nn.Module) -> tuple[bool, ...]:
    """Per parameter, whether it is a routed expert's (megatron marks them allreduce=False); empty
    when none is."""
    mask = tuple(not getattr(p, "allreduce", True) for p in model.parameters())
    return mask if any(mask) else ()


def reset_aux_loss_tracker() -> None:
    """Empty megatron's global MoE aux-loss tracker: it sizes its per-layer tensors by the first
    model that logs into it, and a later probe with more layers would index past them."""
    from capture_megatron.megatron import versioned

    versioned.reset_moe_trackers()


def grouped_workspace(variant: Variant, device: str) -> int:
    """Bytes of TE's multi-stream cuBLAS workspaces that grouped-GEMM experts allocate once per
    process (capture_megatron.emulate.gpu.grouped), on the fake-cuda device; else 0."""
    if device != "fake-cuda" or variant.moe is None or not variant.moe.experts.moe_grouped_gemm:
        return 0
    from capture_megatron.emulate.gpu.grouped import workspace_bytes

    return workspace_bytes()
