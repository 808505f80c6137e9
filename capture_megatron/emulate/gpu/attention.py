"""TE's fused attention backends with megatron's core_attention interface (chosen by
capture_megatron.emulate.gpu.select): FusedAttention (cuDNN F16_arbitrary_seqlen, what TE's
get_attention_backend picks on Hopper for bf16 / fp16 causal attention, preferring it to flash on
sm90) and FlashAttention (flash-attn 2). What each keeps, tensor by tensor, with the TE /
flash-attn source lines: docs/MEMORY_MODEL.md.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from capture_megatron.emulate.gpu.common import is_fake
from capture_megatron.emulate.gpu.cp import RingAttention, cudnn_bwd_workspace, flash_bwd_workspace
from capture_megatron.emulate.gpu.layout import te_qkv

SM_COUNT = 132
"""Streaming multiprocessors of an H100 SXM (flash-attn's deterministic backward splits by it)."""


def _math_attention(q, k, v, scale: float, layout: str):
    """Reference causal attention, dropout-free: output (q's layout, q's dtype) and fp32
    log-sum-exp [b, np, sq]; layout 'sbhd' or 'bshd'."""
    if layout == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (k, v))
    wide = torch.promote_types(q.dtype, torch.float32)
    qb, kb, vb = (t.transpose(1, 2).to(wide) for t in (q, k, v))  # [b, np, s, d]
    scores = qb @ kb.transpose(-1, -2) * scale
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ vb).transpose(1, 2).to(q.dtype)  # [b, s, np, d]
    lse = torch.logsumexp(scores, dim=-1).float()
    return (out.transpose(0, 1) if layout == "sbhd" else out), lse


def _reference_grads(q, k, v, grad, scale: float, layout: str):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = _math_attention(leaves[0], leaves[1], leaves[2], scale, layout)
        return torch.autograd.grad(out, leaves, grad)


def _empty(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


class CuDNNAttention(torch.autograd.Function):
    """TE FusedAttnFunc, cuDNN F16_arbitrary_seqlen, q/k/v in sbhd. Keeps q, k, v, the output O
    [s, b, np, d], softmax statistics fp32 [b, np, s, 1] and an int64 [2] rng state; the backward
    allocates dQ, dK, dV and, in cuDNN's workspace, dQ_accum fp32 [b, np, s, d] and softmax_sum
    fp32 [b, np, s, 1]. No s x s tensor, no dropout mask (dropout replays the Philox state)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, dropout: float):
        """O like q with v's head width (MLA: value heads narrower than query/key heads)."""
        s, b, np_, d = q.shape
        out = _empty((s, b, np_, v.shape[-1]), q.dtype, q)
        stats = _empty((b, np_, s, 1), torch.float32, q)
        rng = _empty((2,), torch.int64, q)
        if not is_fake(q):
            result, lse = _math_attention(q, k, v, scale, "sbhd")
            out.copy_(result)
            stats.copy_(lse.unsqueeze(-1))
        ctx.save_for_backward(q, k, v, out, stats, rng)
        ctx.scale, ctx.dropout = scale, dropout
        return out

    @staticmethod
    def backward(ctx, grad):
        """dQ, dK, dV."""
        q, k, v, out, stats, rng = ctx.saved_tensors
        dq, dk, dv = (_empty(t.shape, t.dtype, t) for t in (q, k, v))
        scratch = cudnn_bwd_workspace(q, k)
        if not is_fake(q):
            for dst, src in zip((dq, dk, dv), _reference_grads(q, k, v, grad, ctx.scale, "sbhd")):
                dst.copy_(src)
        del scratch
        return dq, dk, dv, None, None


class FlashAttention2(torch.autograd.Function):
    """flash-attn 2's flash_attn_func as TE calls it, q/k/v in bshd (contiguous copies made by
    TE). Keeps q, k, v, the output [b, s, np, d], softmax_lse fp32 [b, np, s] and an int64 [2]
    rng state; the backward allocates dq, dk, dv, softmax_d fp32 [b, np, s rounded to 128],
    dq_accum fp32 [b, s rounded to 128, np, d] (deterministic: one per split of the SMs) and,
    with GQA, dk/dv expanded to all heads."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, deterministic: bool):
        """The output like q (bshd)."""
        b, s, np_, d = q.shape
        out = _empty(q.shape, q.dtype, q)
        lse = _empty((b, np_, s), torch.float32, q)
        rng = _empty((2,), torch.int64, q)
        if not is_fake(q):
            result, ref = _math_attention(q, k, v, scale, "bshd")
            out.copy_(result)
            lse.copy_(ref)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.scale, ctx.deterministic = scale, deterministic
        return out

    @staticmethod
    def backward(ctx, grad):
        """dq, dk, dv."""
        q, k, v, out, lse, rng = ctx.saved_tensors
        dq, dk, dv = (_empty(t.shape, t.dtype, t) for t in (q, k, v))
        scratch = flash_bwd_workspace(q, k, SM_COUNT, ctx.deterministic)
        if not is_fake(q):
            for dst, src in zip((dq, dk, dv), _reference_grads(q, k, v, grad, ctx.scale, "bshd")):
                dst.copy_(src)
        del scratch
        return dq, dk, dv, None, None


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class _CoreAttention(_megatron_module()):  # type: ignore[misc]  # a base class imported on demand
    """megatron's core_attention interface for causal self-attention."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        # p2p: others are refused (config.context); MLA's head widths come with its tensors
        del attention_type, cp_comm_type, k_channels, v_channels
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"the GPU kernel set models causal attention, not {attn_mask_type}")
        # context-parallel ranks of the ring attention (1: none)
        self.cp = 1
        if config.context_parallel_size > 1:
            group = getattr(pg_collection, "cp", None)
            self.cp = (group if group is not None else ps.get_context_parallel_group()).size()
        self.layer_number = layer_number
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.deterministic = config.deterministic_mode

    def _check(self, attention_bias, packed_seq_params) -> None:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("attention bias / packed sequences are not modelled")


class FusedCoreAttention(_CoreAttention):
    """TE DotProductAttention with the FusedAttention backend (auto / fused on Hopper)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        """[sq, b, np, d] x [sk, b, ng, d] -> [sq, b, np * d] (a view of the kept output)."""
        self._check(attention_bias, packed_seq_params)
        q, k, v = te_qkv(query, key, value)
        if self.cp > 1:  # TE makes them contiguous for its context-parallel function
            q, k, v = (t.contiguous() for t in (q, k, v))
            out = RingAttention.apply(q, k, v, self.cp, "sbhd", cudnn_bwd_workspace)
        else:
            dropout = self.dropout if self.training else 0.0
            out = CuDNNAttention.apply(q, k, v, self.scale, dropout)
        return out.view(out.shape[0], out.shape[1], -1)


class FlashCoreAttention(_CoreAttention):
    """TE DotProductAttention with the FlashAttention backend (flash-attn 2)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        """[sq, b, np, d] x [sk, b, ng, d] -> [sq, b, np * d] (a contiguous copy, as TE returns)."""
        self._check(attention_bias, packed_seq_params)
        q, k, v = te_qkv(query, key, value)
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # TE: sbhd -> bshd copies
        if self.cp > 1:
            workspace = partial(flash_bwd_workspace, sm_count=SM_COUNT, det=self.deterministic)
            out = RingAttention.apply(q, k, v, self.cp, "bshd", workspace)
        else:
            out = FlashAttention2.apply(q, k, v, self.scale, self.deterministic)
        b, s = out.shape[:2]
        return out.view(b, s, -1).transpose(0, 1).contiguous()
