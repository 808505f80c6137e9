"""Where megatron's torch.compile'd functions keep more than their eager code.

Megatron-LM compiles its fused functions (megatron/core/jit.py: jit_fuser = torch.compile). The
fake-cuda device runs them eagerly (TORCHDYNAMO_DISABLE), which keeps the same tensors for
backward — checked from Inductor's generated code for each one (TORCH_LOGS=output_code, torch
2.13): bias-dropout-add keeps a bool mask, as eager; bias-GeLU / bias-SwiGLU allocate only their
outputs, as eager. One differs: the native fused cross entropy's `calculate_gradients`
(megatron/core/fusions/fused_cross_entropy.py, --cross-entropy-loss-fusion) is an index_put
followed by a multiply on the saved fp32 softmax; Inductor materialises the index_put into a new
fp32 [s * b, V / t] buffer, then writes the bf16 gradient and the softmax in place, so the
compiled backward holds 10 bytes per logit (saved fp32 softmax, the fp32 buffer, the bf16
gradient) where the eager one holds 6. Another is megatron's L2Norm (--qk-l2-norm): eager keeps
fp32 copies, the compiled function (AOTAutograd's min-cut partition, read from its forward graph
on the CPU, torch 2.13) keeps the input as given and rsqrt fp32 [..., 1] (CompiledL2Norm).
"""

from __future__ import annotations

import functools

import torch

from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import is_fake


def with_inductor_buffer(calculate_gradients):
    """calculate_gradients that also allocates the fp32 buffer Inductor's kernel uses."""

    @functools.wraps(calculate_gradients)
    def wrapped(softmax, grad_output, target_mask, masked_target_1d):
        vocab = softmax.shape[-1]
        buffer = torch.empty(
            (softmax.numel() // vocab, vocab), dtype=torch.float32, device=softmax.device
        )
        grad = calculate_gradients(softmax, grad_output, target_mask, masked_target_1d)
        del buffer
        return grad

    return wrapped


class _L2Norm(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) in fp32, back in x's dtype, keeping what AOTAutograd's
    min-cut partition of megatron's compiled L2Norm._norm saves (torch 2.13): the input as given
    and rsqrt fp32 [..., 1]; the output and, in backward, the input gradient are new."""

    @staticmethod
    def forward(ctx, x, eps: float):
        """The L2-normalised x."""
        out = torch.empty_like(x)
        rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        if not is_fake(x):
            rstd.copy_(torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))
            out.copy_(x.float() * rstd)
        ctx.save_for_backward(x, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        """The input gradient."""
        x, rstd = ctx.saved_tensors
        dx = torch.empty_like(x)
        if not is_fake(x):
            xf, g = x.float(), grad.float()
            dot = (g * xf).sum(-1, keepdim=True)
            dx.copy_(g * rstd - xf * dot * rstd.pow(3) / x.shape[-1])
        return dx, None


class CompiledL2Norm(torch.nn.Module):
    """megatron-core's L2Norm (--qk-l2-norm) as its torch.compile'd formula keeps tensors."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The L2-normalised x."""
        return _L2Norm.apply(x, self.eps)


def install() -> None:
    """Patch megatron's fused cross entropy (idempotent)."""
    from megatron.core.fusions import fused_cross_entropy as fce

    if not getattr(fce.calculate_gradients, "capture_megatron", False):
        wrapped = with_inductor_buffer(fce.calculate_gradients)
        wrapped.capture_megatron = True  # our marker
        why = "fake-cuda kernel set: the buffer compiled fused cross entropy allocates"
        patches.patch(fce, "calculate_gradients", wrapped, why)
