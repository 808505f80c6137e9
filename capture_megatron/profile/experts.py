"""What probes of mixture-of-experts chunks need beyond dense ones: the fake job's size, which
parameters are routed experts', and what is not profiled yet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from capture_megatron.config import Kernels
from capture_megatron.config.context import context_problem
from capture_megatron.config.flex import flex_problems
from capture_megatron.config.fp8 import fp8_problem
from capture_megatron.config.kernels import kernel_set, tp_overlap_problem
from capture_megatron.errors import CaptureError
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
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def refuse_on_fake_device(variant: Variant, device: str, kernels: Kernels) -> None:
    """CaptureError for what a fake device cannot model: on fake-cuda context parallelism
    without TE's flash or fused attention (Megatron's local attention and TE's unfused backend
    do not run it) and grouped-GEMM experts with linear biases (the kernel set's GroupedLinear
    has none)."""
    problem = context_problem((variant.cp,), "", "gpu", kernels) if device == "fake-cuda" else ""
    problem = problem or _fp8_device_problem(device, kernels)
    problem = problem or _overlap_device_problem(device, kernels)
    if not problem and kernels.fp8 and variant.recompute_modules:
        problem = (
            f"--recompute-modules {' '.join(variant.recompute_modules)} with --fp8-format: "
            "selective recompute of modules other than core_attn under FP8 runs Transformer "
            "Engine's own checkpoint (te_checkpoint, and TE's saved original inputs), which the "
            "GPU kernel set does not emulate yet; leave out --recompute-modules or FP8"
        )
    problem = problem or _flex_device_problem(variant, device)
    if problem:
        raise CaptureError(problem)
    grouped = variant.moe is not None and variant.moe.experts.moe_grouped_gemm
    if device == "fake-cuda" and grouped and variant.add_bias_linear:
        raise CaptureError(
            "--moe-grouped-gemm with linear biases is not modelled on the GPU kernel set (its "
            "emulation of Transformer Engine's GroupedLinear has no biases); give "
            "--disable-bias-linear, or leave out --moe-grouped-gemm"
        )


def _flex_device_problem(variant: Variant, device: str) -> str:
    """Why a flex-dispatcher probe of `variant` cannot run on `device` ('' when it can, or
    without flex): the CPU kernel set has no DeepEP / HybridEP, a real GPU would need them
    installed (probing there is not implemented), and the fake-cuda rules of
    capture_megatron.config.flex."""
    moe = variant.moe
    if moe is None or moe.experts.moe_token_dispatcher_type != "flex":
        return ""
    if device == "cuda":
        return (
            "--moe-token-dispatcher-type flex: flex probes run on the GPU kernel set's emulation "
            "of HybridEP (--device fake-cuda); probing DeepEP / HybridEP on a real GPU is not "
            "implemented yet"
        )
    cpu, group = device != "fake-cuda", moe.ep * moe.etp
    # NVLink domains are the planner's check (capture_megatron.planner.run): a probe's group
    # counts as one domain here
    problems = flex_problems(moe.experts, variant.dtype, group, group, cpu=cpu)
    return "; ".join(problems)


def _fp8_device_problem(device: str, kernels: Kernels) -> str:
    """Why FP8 probes of `kernels` cannot run on `device` ('' when they can, or without FP8)."""
    if not kernels.fp8:
        return ""
    if device == "cuda":
        return (
            f"--fp8-format {kernels.fp8_format}: FP8 probes run on the GPU kernel set's emulation "
            "(--device fake-cuda); probing FP8 with Transformer Engine on a real GPU is not "
            "implemented yet"
        )
    return fp8_problem(kernel_set(device, kernels), kernels)


def _overlap_device_problem(device: str, kernels: Kernels) -> str:
    """Why --tp-comm-overlap probes cannot run on `device` ('' when they can, or without it)."""
    if kernels.tp_comm_overlap and device == "cuda":
        return (
            "--tp-comm-overlap: its probes run on the GPU kernel set's emulation (--device "
            "fake-cuda); probing TE's userbuffers on a real GPU is not implemented yet"
        )
    return tp_overlap_problem(kernel_set(device, kernels), kernels)


def grouped_workspace(variant: Variant, device: str) -> int:
    """Bytes of TE's multi-stream cuBLAS workspaces that grouped-GEMM experts allocate once per
    process (capture_megatron.emulate.gpu.grouped), on the fake-cuda device; else 0."""
    if device != "fake-cuda" or variant.moe is None or not variant.moe.experts.moe_grouped_gemm:
        return 0
    from capture_megatron.emulate.gpu.grouped import workspace_bytes

    return workspace_bytes()
