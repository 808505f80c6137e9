"""Transformer Engine's q/k/v layout check (DotProductAttention.forward -> get_qkv_layout, TE
5671fd36 transformer_engine/pytorch/attention/dot_product_attention/utils.py:1918-2035), which
decides whether attention keeps the caller's q, k, v or contiguous copies of them.

TE accepts q, k, v that are views of one projection output interleaved as sb3hd / sbh3d, k and v
interleaved as sb2hd / sbh2d, or three separately laid out tensors; anything else it makes
contiguous (`q, k, v = [x.contiguous() for x in [q, k, v]]`). With megatron's fused QKV
projection: MHA without RoPE keeps the views (sbh3d, no copy); with RoPE, q and k are fresh
contiguous tensors while v stays a strided view, so v is copied; GQA without RoPE copies k and v.
Storage identity stands in for TE's data pointers (fake tensors have none).
"""

from __future__ import annotations

import math

import torch


def _same(*tensors: torch.Tensor) -> bool:
    first = tensors[0].untyped_storage()._cdata
    return all(t.untyped_storage()._cdata == first for t in tensors)


def _supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether TE recognises the layout (one of its run_iteratively cases)."""
    ptrs_qkv, ptrs_qk, ptrs_kv = _same(q, k, v), _same(q, k), _same(k, v)
    shapes_qkv = q.shape == k.shape == v.shape
    shapes_kv = k.shape[:-1] == v.shape[:-1]
    strides_qkv = q.stride() == k.stride() == v.stride()
    strides_kv = tuple(x / k.shape[-1] for x in k.stride()[:-1]) == tuple(
        x / v.shape[-1] for x in v.stride()[:-1]
    )
    offsets = [t.storage_offset() for t in (q, k, v)]
    hd, d = q.shape[-1] * q.shape[-2], q.shape[-1]
    if ptrs_qkv and strides_qkv and shapes_qkv and offsets in ([0, hd, 2 * hd], [0, d, 2 * d]):
        return True  # sb3hd / sbh3d
    sizes = [math.prod(t.shape) for t in (q, k)]
    base = sizes[0] if ptrs_qkv else 0
    khd, kd = k.shape[-1] * k.shape[-2], k.shape[-1]
    kv_offsets = ([base, base + khd], [base, base + kd])
    if ptrs_kv and strides_kv and shapes_kv and offsets[1:] in kv_offsets:
        return True  # sbhd_sb2hd / sbhd_sbh2d
    if not (strides_kv and shapes_kv):
        return False
    qkv = offsets == [0, sizes[0], sizes[0] + sizes[1]] if ptrs_qkv else offsets == [0, 0, 0]
    qk = offsets[:2] == [0, sizes[0]] if not ptrs_qkv and ptrs_qk else offsets[:2] == [0, 0]
    kv = offsets[1:] == [0, sizes[1]] if not ptrs_qkv and ptrs_kv else offsets[1:] == [0, 0]
    return qkv or qk or kv  # sbhd_sbhd_sbhd


def te_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as TE's attention backends receive them (contiguous copies when TE makes them)."""
    if _supported(q, k, v):
        return q, k, v
    return q.contiguous(), k.contiguous(), v.contiguous()
