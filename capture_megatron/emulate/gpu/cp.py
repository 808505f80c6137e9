"""Transformer Engine's ring context-parallel attention (cp_comm_type "p2p", Megatron-LM's default)
as the GPU kernel set keeps it: TE 2.8's AttnFuncWithCPAndKVP2P
(transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py) for bf16 / fp16
causal attention, with the flash-attn 2 backend (q, k, v in bshd) or cuDNN's fused one (sbhd).

Each CP rank holds 2 of the sequence's 2 x cp chunks (load-balanced causal split). The forward runs
cp steps, each attending the local queries to one rank's K/V passed around the ring, and merges
the per-step outputs with their log-sum-exps. What it allocates, in TE's order:
- forward: K and V concatenated into one flat buffer (`torch.cat`), one more such buffer per step
  for the ring (all alive until the forward returns), a per-step output like q and fp32 lse
  [b, np, s/cp] (kept in lists until the merge), a clone of the first lse and the merged output
  like q (TE's jit-fused correction writes it in q's dtype, no fp32 temporaries);
- it keeps q, the last ring buffer (K and V), the merged output, the merged fp32 lse and an int64
  [2] rng state per step;
- the backward allocates dq like q, two [2, K+V] ring buffers (the received K/V and the dK/dV
  passed on), per step the kernel's dq, dk, dv of that tile and its workspace, and returns dq and
  dK/dV as views of the last ring buffer, which stays alive with them.
The CP rank modelled is the last one (the rank Megatron-LM's logs report, and the largest: every
step after the first is a lower-triangle tile with all of its queries and half the keys).

Fake tensors only: a real GPU runs TE's own function; no values are computed here.
"""

from __future__ import annotations

import torch

from capture_megatron.emulate.gpu.common import is_fake
from capture_megatron.errors import CaptureError


def _empty(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def _lse_shape(q: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """[b, np, sq] of q in `layout` ('bshd' or 'sbhd')."""
    b, s = (q.shape[0], q.shape[1]) if layout == "bshd" else (q.shape[1], q.shape[0])
    return b, q.shape[2], s


def _half_seq(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The first of the two chunks a rank holds (a view, as TE's k_part[:, 0] / k_part[0])."""
    dim = 1 if layout == "bshd" else 0
    return t.narrow(dim, 0, t.shape[dim] // 2)


def flash_bwd_workspace(q: torch.Tensor, k: torch.Tensor, sm_count: int, det: bool):
    """flash-attn 2's backward temporaries of one call on bshd q [b, s, np, d] and k: softmax_d
    fp32 [b, np, s rounded to 128], dq_accum fp32 [splits, b, s rounded, np, d rounded to 32] (one
    split per share of the SMs when `det`erministic) and, with GQA, dk/dv expanded to all heads."""
    b, s, np_, d = q.shape
    s_r, d_r = -(-s // 128) * 128, -(-d // 32) * 32
    splits = -(-sm_count // (b * np_)) if det else 1
    out = [
        _empty((b, np_, s_r), torch.float32, q),
        _empty((splits, b, s_r, np_, d_r), torch.float32, q),
    ]
    if k.shape[2] != np_:
        out += [_empty((b, k.shape[1], np_, d), q.dtype, q) for _ in range(2)]
    return out


def cudnn_bwd_workspace(q: torch.Tensor, k: torch.Tensor):
    """cuDNN F16_arbitrary_seqlen's backward workspace for sbhd q [s, b, np, d] (any k): dQ_accum
    fp32 [b, np, s, d] and softmax_sum fp32 [b, np, s, 1]."""
    del k
    s, b, np_, d = q.shape
    return [
        _empty((b, np_, s, d), torch.float32, q),
        _empty((b, np_, s, 1), torch.float32, q),
    ]


class RingAttention(torch.autograd.Function):
    """AttnFuncWithCPAndKVP2P on fake tensors (see the module docstring): q, k, v in `layout`
    ('bshd': flash-attn 2; 'sbhd': cuDNN), causal, `cp` ranks, the last one modelled;
    `workspace(q, k)`: the kernel's backward temporaries of one tile."""

    @staticmethod
    def forward(ctx, q, k, v, cp: int, layout: str, workspace):
        """The merged output like q."""
        if not is_fake(q, k, v):
            raise CaptureError(
                "the GPU kernel set's context-parallel attention runs on the fake CUDA device "
                "only (it emulates what Transformer Engine allocates and computes no values)"
            )
        lse_shape = _lse_shape(q, layout)
        ring = [torch.cat((k.reshape(-1), v.reshape(-1)))]
        outs, lses, rngs = [], [], []
        merged_lse = None
        for step in range(cp):
            if step < cp - 1:
                ring.append(torch.empty_like(ring[step]))
            outs.append(torch.empty_like(q))
            lses.append(_empty(lse_shape, torch.float32, q))
            rngs.append(_empty((2,), torch.int64, q))
            if step == 1:
                merged_lse = lses[0].clone()
        if merged_lse is None:
            merged_lse = lses[0].clone()
        out = torch.empty_like(q)
        kv = ring[-1]
        del ring, outs, lses
        ctx.save_for_backward(q, kv, out, merged_lse, *rngs)
        ctx.cp, ctx.layout, ctx.workspace = cp, layout, workspace
        ctx.k_shape, ctx.v_shape = k.shape, v.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        """dq, and dk / dv as views of the last ring buffer."""
        q, kv = ctx.saved_tensors[:2]
        dq = torch.empty_like(q)
        ring = [_empty((2, kv.numel()), kv.dtype, kv) for _ in range(2)]
        k_numel = ctx.k_shape.numel()
        k = kv[:k_numel].view(ctx.k_shape)
        for step in range(ctx.cp):
            k_part = k if step == 0 else _half_seq(k, ctx.layout)
            tile = [torch.empty_like(q), torch.empty_like(k_part), torch.empty_like(k_part)]
            scratch = ctx.workspace(q, k_part)
            del tile, scratch
        dkv = ring[ctx.cp % 2][1]
        del ring
        dk = dkv[:k_numel].view(ctx.k_shape)
        dv = dkv[k_numel:].view(ctx.v_shape)
        return dq, dk, dv, None, None, None
