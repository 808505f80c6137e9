"""Transformer Engine's fused MoE token permutation (--moe-permute-fusion) on the fake-cuda device.

megatron-core's moe_utils.permute / unpermute / sort_chunks_by_idxs call TE's moe_permute,
moe_permute_with_probs, moe_unpermute and moe_sort_chunks_by_index(_with_probs) when
config.moe_permute_fusion is set (megatron/core/extensions/transformer_engine.py: fused_permute
...). TE 5671fd36 (transformer_engine/pytorch/permutation.py, triton/permutation.py) allocates
and keeps, where megatron's unfused path keeps a transposed routing mask (masked_select's, or the
argsort of padded routing), the sorted token indices (int64) and index tensors:

- permute (`_moe_permute_mask_map`): a row_id_map int32 [tokens, 2 x experts + 1]
  (`make_row_id_map`, with an int32 [experts, ceil(tokens / 1024)] workspace, transient), the
  permuted tokens [out, hidden] and, with probabilities, the permuted probabilities [out]; it
  keeps the row_id_map (`ctx.save_for_backward(row_id_map, pad_offsets)`), which the dispatcher
  also keeps as its permutation mapping until the next forward;
- unpermute (`_moe_unpermute_mask_map`): the output [tokens, hidden]; it keeps the row_id_map, and
  with merging probabilities also its input and the probabilities;
- chunk sort (`_moe_chunk_sort`): a row_id_map int32 [tokens] (`make_chunk_sort_map`), the sorted
  tokens and probabilities; it keeps the row_id_map.
Backward allocates the input gradients (tokens and, with probabilities, [tokens, experts]). On
real tensors these functions compute the real result (tests check them against megatron's unfused
code); on fake tensors they only allocate.
"""

from __future__ import annotations

import torch

from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import is_fake


def _destinations(routing_map: torch.Tensor) -> torch.Tensor:
    """Per (token, expert) the permuted row (expert-major order, as megatron's permute), -1 where
    not routed."""
    mask = routing_map.bool().T  # [experts, tokens]
    rows = torch.full(mask.shape, -1, dtype=torch.int64, device=mask.device)
    rows[mask] = torch.arange(int(mask.sum()), device=mask.device)
    return rows.T  # [tokens, experts]


class Permute(torch.autograd.Function):
    """TE's _moe_permute_mask_map."""

    @staticmethod
    def forward(ctx, inp, routing_map, num_out_tokens: int, probs):
        """(permuted tokens, row_id_map, permuted probabilities or None)."""
        tokens, hidden = inp.shape
        experts = routing_map.shape[1]
        row_id_map = torch.empty((tokens, 2 * experts + 1), dtype=torch.int32, device=inp.device)
        workspace = torch.empty((experts, -(-tokens // 1024)), dtype=torch.int32, device=inp.device)
        del workspace
        out = torch.empty((num_out_tokens, hidden), dtype=inp.dtype, device=inp.device)
        permuted_probs = None
        if probs is not None:
            permuted_probs = torch.empty(num_out_tokens, dtype=probs.dtype, device=inp.device)
        if not is_fake(inp):
            dest = _destinations(routing_map)
            row_id_map.zero_()
            row_id_map[:, :experts] = dest.to(torch.int32)
            token, expert = (dest >= 0).nonzero(as_tuple=True)
            out[dest[token, expert]] = inp[token]
            if permuted_probs is not None:  # given probs
                permuted_probs[dest[token, expert]] = probs[token, expert]
        ctx.save_for_backward(row_id_map)
        ctx.mark_non_differentiable(row_id_map)
        ctx.shape, ctx.experts, ctx.probs_dtype = inp.shape, experts, None
        if probs is not None:
            ctx.probs_dtype = probs.dtype
        return out, row_id_map, permuted_probs

    @staticmethod
    def backward(ctx, grad, _, grad_probs):
        """The tokens' gradient (and the probabilities', [tokens, experts])."""
        (row_id_map,) = ctx.saved_tensors
        act = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        probs = None
        if ctx.probs_dtype is not None:
            probs = torch.empty(
                (ctx.shape[0], ctx.experts), dtype=ctx.probs_dtype, device=grad.device
            )
        if not is_fake(grad):
            dest = row_id_map[:, : ctx.experts].long()
            act.copy_(_gather_sum(grad, dest))
            if probs is not None:
                g = grad_probs if grad_probs is not None else torch.zeros(grad.shape[0])
                probs.copy_(torch.where(dest >= 0, g[dest.clamp(min=0)], 0).to(probs.dtype))
        return act, None, None, probs


def _gather_sum(permuted: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Per token the sum of its permuted rows (dest: [tokens, experts], -1 where not routed)."""
    picked = permuted[dest.clamp(min=0)] * (dest >= 0).unsqueeze(-1).to(permuted.dtype)
    return picked.sum(1)


class Unpermute(torch.autograd.Function):
    """TE's _moe_unpermute_mask_map without merging probabilities (megatron passes none)."""

    @staticmethod
    def forward(ctx, inp, row_id_map, restore_shape):
        """The tokens restored to their order, each the sum of its experts' rows."""
        experts = (row_id_map.shape[1] - 1) // 2
        out = torch.empty(tuple(restore_shape), dtype=inp.dtype, device=inp.device)
        if not is_fake(inp):
            out.copy_(_gather_sum(inp, row_id_map[:, :experts].long()))
        ctx.save_for_backward(row_id_map)
        ctx.rows, ctx.experts = inp.shape[0], experts
        return out

    @staticmethod
    def backward(ctx, grad):
        """The permuted rows' gradient (each its token's)."""
        (row_id_map,) = ctx.saved_tensors
        act = torch.empty((ctx.rows, grad.shape[-1]), dtype=grad.dtype, device=grad.device)
        if not is_fake(grad):
            dest = row_id_map[:, : ctx.experts].long()
            token, expert = (dest >= 0).nonzero(as_tuple=True)
            act[dest[token, expert]] = grad[token]
        return act, None, None


class ChunkSort(torch.autograd.Function):
    """TE's _moe_chunk_sort: the token chunks (split_sizes) reordered by sorted_idxs."""

    @staticmethod
    def forward(ctx, inp, split_sizes, sorted_idxs, probs):
        """(sorted tokens, sorted probabilities or None)."""
        tokens = inp.shape[0]
        row_id_map = torch.empty(tokens, dtype=torch.int32, device=inp.device)
        out = torch.empty_like(inp)
        sorted_probs = None if probs is None else torch.empty_like(probs)
        if not is_fake(inp):
            order = _chunk_order(split_sizes, sorted_idxs, tokens, inp.device)
            row_id_map.copy_(order.to(torch.int32))
            out.copy_(inp[order])
            if sorted_probs is not None:  # given probs
                sorted_probs.copy_(probs[order])
        ctx.save_for_backward(row_id_map)
        ctx.with_probs = probs is not None
        return out, sorted_probs

    @staticmethod
    def backward(ctx, grad, grad_probs):
        """The gradients back in the input's order."""
        (row_id_map,) = ctx.saved_tensors
        act = torch.empty_like(grad)
        probs = torch.empty_like(grad_probs) if ctx.with_probs else None
        if not is_fake(grad):
            act[row_id_map.long()] = grad
            if probs is not None:
                probs[row_id_map.long()] = grad_probs
        return act, None, None, probs


def _chunk_order(split_sizes, sorted_idxs, tokens: int, device) -> torch.Tensor:
    """The source row of each output row when chunks are concatenated in sorted_idxs order."""
    starts = torch.cumsum(split_sizes.long(), 0) - split_sizes.long()
    rows = [torch.arange(int(starts[i]), int(starts[i] + split_sizes[i])) for i in sorted_idxs]
    return torch.cat(rows).to(device) if rows else torch.empty(0, dtype=torch.long)


def moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask"):
    """TE's moe_permute (mask map): (permuted tokens, row_id_map)."""
    del max_token_num, map_type
    out, row_id_map, _ = Permute.apply(inp, routing_map, int(num_out_tokens), None)
    return out, row_id_map


def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1):
    """TE's moe_permute_with_probs: (permuted tokens, permuted probabilities, row_id_map)."""
    out, row_id_map, permuted_probs = Permute.apply(inp, routing_map, int(num_out_tokens), probs)
    return out, permuted_probs, row_id_map


def moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask"):
    """TE's moe_unpermute (mask map) as megatron calls it: no merging probabilities."""
    del map_type
    if merging_probs is not None:
        raise ValueError("the GPU kernel set's fused unpermute takes no merging probabilities")
    return Unpermute.apply(inp, row_id_map, restore_shape or inp.shape)


def moe_sort_chunks_by_index(inp, split_sizes, sorted_index):
    """TE's moe_sort_chunks_by_index."""
    return ChunkSort.apply(inp, split_sizes, sorted_index, None)[0]


def moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index):
    """TE's moe_sort_chunks_by_index_with_probs: (sorted tokens, sorted probabilities)."""
    return ChunkSort.apply(inp, split_sizes, sorted_index, probs)


def install() -> None:
    """Give megatron's moe_utils TE's fused permutation (idempotent)."""
    from megatron.core.transformer.moe import moe_utils

    why = "fake-cuda kernel set: TE's fused MoE permutation"
    patches.patch(moe_utils, "HAVE_TE", True, why)
    for name, fn in (
        ("fused_permute", moe_permute),
        ("fused_permute_with_probs", moe_permute_with_probs),
        ("fused_unpermute", moe_unpermute),
        ("fused_sort_chunks_by_index", moe_sort_chunks_by_index),
        ("fused_sort_chunks_by_index_with_probs", moe_sort_chunks_by_index_with_probs),
    ):
        patches.patch(moe_utils, name, fn, why, adds=True)  # bound only with TE
