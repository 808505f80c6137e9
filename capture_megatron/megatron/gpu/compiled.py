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
gradient) where the eager one holds 6.
"""

from __future__ import annotations

import functools

import torch


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


def install() -> None:
    """Patch megatron's fused cross entropy (idempotent)."""
    from megatron.core.fusions import fused_cross_entropy as fce

    if not getattr(fce.calculate_gradients, "capture_megatron", False):
        fce.calculate_gradients = with_inductor_buffer(fce.calculate_gradients)
        fce.calculate_gradients.capture_megatron = True  # type: ignore[attr-defined]
