"""Transformer Engine's UnfusedDotProductAttention (--attention-backend unfused), as megatron's
TEDotProductAttention runs it: plain torch ops on CUDA plus TE's fused masked softmax.

Mirrors TE 5671fd36 transformer_engine/pytorch/attention/dot_product_attention/backends.py
UnfusedDotProductAttention.forward (lines 380-602) and softmax.py FusedScaleMaskSoftmax:
1. get_full_mask: a bool [1, 1, s, s] causal mask, or-ed with the dataloader's [b, 1, s, s] mask
   when megatron passes one (a new bool [b, 1, s, s]); not kept.
2. GQA: key and value repeated to every head (repeat_interleave: new tensors).
3. scores: `torch.empty` then an out-of-place baddbmm in the activation dtype (two score-sized
   buffers for a moment); the scores stay referenced until forward returns; baddbmm keeps q, k.
4. softmax: TE's kernel when 16 < sk < 16384, sk % 8 == 0, sq == sk (causal), sq % 4 == 0,
   b * np % 4 == 0 and sq % batch_per_block == 0: ScaledMaskedSoftmax keeps only its 16-bit
   output, its backward works in place (csrc/extensions/softmax.cpp). Otherwise torch's softmax
   in fp32 (TE constructs FusedScaleMaskSoftmax with softmax_in_fp32=True, whatever Megatron's
   --attention-softmax-in-fp32 says) keeps the fp32 probabilities.
5. dropout (CUDA native_dropout: a bool mask), bmm with v (keeps the dropout output and v), the
   context permuted to [s, b, np * d] by a contiguous copy (kept by linear_proj).
"""

from __future__ import annotations

import torch

from capture_megatron.emulate.gpu.attention import _CoreAttention
from capture_megatron.emulate.gpu.common import is_fake
from capture_megatron.emulate.gpu.layout import te_qkv
from capture_megatron.emulate.gpu.softmax import MASK_FILL, batch_per_block


class TEMaskedSoftmax(torch.autograd.Function):
    """TE's ScaledMaskedSoftmax kernel: a 16-bit output, kept; backward in place."""

    @staticmethod
    def forward(ctx, scores, mask):
        """softmax(scores masked) in the scores' dtype."""
        out = torch.empty_like(scores)
        if not is_fake(scores):
            out.copy_(torch.softmax(scores.float().masked_fill(mask, MASK_FILL), -1))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        """The input gradient, written into the incoming gradient."""
        (out,) = ctx.saved_tensors
        if not is_fake(grad):
            g, y = grad.float(), out.float()
            grad.copy_((g - (g * y).sum(-1, keepdim=True)) * y)
        return grad, None


def kernel_available(b: int, np_: int, sq: int, sk: int, dtype: torch.dtype) -> bool:
    """TE FusedScaleMaskSoftmax.is_kernel_available for a causal mask."""
    if dtype not in (torch.float16, torch.bfloat16) or not 16 < sk < 16384 or sk % 8:
        return False
    if sq == 1 or sq != sk or sq % 4 or (b * np_) % 4:
        return False
    return sq % te_batch_per_block(sk) == 0


def te_batch_per_block(sk: int) -> int:
    """TE's get_batch_per_block (the same launch arithmetic as megatron's kernels)."""
    return batch_per_block(sk, sk, 1, 1)


class UnfusedCoreAttention(_CoreAttention):
    """TE's UnfusedDotProductAttention for causal self-attention (see the module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        """[sq, b, np, d] x [sk, b, ng, d] -> [sq, b, np * d]."""
        self._check(attention_bias, packed_seq_params)
        q, k, v = te_qkv(query, key, value)
        s, b, np_, d = q.shape
        mask = torch.ones((1, 1, s, s), dtype=torch.bool, device=q.device).triu(1)
        if attention_mask is not None:
            mask = torch.logical_or(mask, attention_mask)
        if k.shape[2] != np_:
            k, v = (t.repeat_interleave(np_ // t.shape[2], dim=2) for t in (k, v))
        q3, k3 = q.reshape(s, b * np_, d), k.reshape(s, b * np_, d)
        scores = torch.empty((b * np_, s, s), dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(
            scores, q3.transpose(0, 1), k3.transpose(0, 1).transpose(1, 2), beta=0.0,
            alpha=self.scale,
        )  # fmt: skip
        probs = self._softmax(scores.view(b, np_, s, s), mask)
        if self.training and self.dropout:
            with self._rng():
                probs = torch.nn.functional.dropout(probs, self.dropout)
        dv = v.shape[-1]  # MLA: value heads narrower than query/key heads
        context = torch.bmm(probs.view(b * np_, s, s), v.reshape(s, b * np_, dv).transpose(0, 1))
        context = context.view(b, np_, s, dv).permute(2, 0, 1, 3).contiguous()
        return context.view(s, b, np_ * dv)

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, np_, sq, sk = scores.shape
        if kernel_available(b, np_, sq, sk, scores.dtype):
            return TEMaskedSoftmax.apply(scores, mask)
        probs = torch.softmax(scores.float().masked_fill_(mask, MASK_FILL), dim=-1)
        return probs.to(scores.dtype)

    def _rng(self):
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().fork()
