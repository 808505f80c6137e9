"""What probes of mixture-of-experts chunks need beyond dense ones: the fake job's size, which
parameters are routed experts', and what is not profiled yet."""

from __future__ import annotations

from capture_megatron.config import Kernels
from capture_megatron.config.context import context_problem
from capture_megatron.errors import CaptureError
from capture_megatron.records import Probe, Variant


def probe_world(probe: Probe) -> tuple[int, int, int, int]:
    """(dp, ep, etp, cp) of the fake job a probe runs in: its DP, raised to the least multiple for
    which EP x ETP divides TP x CP x DP."""
    moe, tp, dp, cp = probe.variant.moe, probe.shape.tp, probe.dp, probe.variant.cp
    if moe is None:
        return dp, 1, tp, cp
    while (tp * cp * dp) % (moe.ep * moe.etp):
        dp += probe.dp
    return dp, moe.ep, moe.etp, cp


def expert_mask(model) -> tuple[bool, ...]:
    """Per parameter, whether it is a routed expert's (megatron marks them allreduce=False); empty
    when none is."""
    mask = tuple(not getattr(p, "allreduce", True) for p in model.parameters())
    return mask if any(mask) else ()


def reset_aux_loss_tracker() -> None:
    """Empty megatron's global MoE aux-loss tracker: it sizes its per-layer tensors by the first
    model that logs into it, and a later probe with more layers would index past them."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def refuse_on_fake_device(variant: Variant, device: str, kernels: Kernels) -> None:
    """CaptureError for what a fake device cannot model yet: on fake-cuda MoE layers (the GPU
    kernel set's MoE modules are not emulated) and context parallelism without TE's flash or
    fused attention (Megatron's local attention and TE's unfused backend do not run it); on
    fake-cpu MoE layers with another dispatcher than alltoall (the allgather dispatcher selects
    its tokens by value, which fake tensors do not hold)."""
    problem = context_problem((variant.cp,), "", "gpu", kernels) if device == "fake-cuda" else ""
    if problem:
        raise CaptureError(problem)
    if variant.moe is not None and device == "fake-cuda":
        raise CaptureError(
            "mixture-of-experts layers are not modelled on the fake CUDA device yet (the GPU "
            "kernel set's MoE modules are not emulated); forecast them for the CPU kernel set "
            "(--device cpu) or profile on a GPU"
        )
    dispatcher = variant.moe.experts.moe_token_dispatcher_type if variant.moe else "alltoall"
    if device == "fake-cpu" and dispatcher != "alltoall":
        raise CaptureError(
            f"--moe-token-dispatcher-type {dispatcher} is not modelled under --device fake-cpu: "
            "the dispatcher selects tokens by their routing values, which fake tensors do not "
            "hold; forecast it with --device cpu (at sizes that fit this machine), or with the "
            "alltoall dispatcher"
        )
