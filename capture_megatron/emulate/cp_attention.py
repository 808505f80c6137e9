"""Context parallelism (--context-parallel-size) where Transformer Engine is absent.

megatron-core 0.16.1's local-spec DotProductAttention refuses CP > 1 ("only supported by
TEDotProductAttention"). AllGatherCPAttention is that module made context-parallel the simplest
exact way: each CP rank keeps its own queries, all-gathers K and V over the CP group (autograd's
backward reduce-scatters their gradients: every rank's queries contribute to every key), and masks
the scores with the causal mask of Megatron's load-balanced chunking -- the sequence is cut in
2 x cp chunks and CP rank r holds chunks r and 2cp-1-r (megatron.core.utils
get_batch_on_this_cp_rank; RotaryEmbedding slices its table the same way). It is TE's
``cp_comm_type="all_gather"`` algorithm with the unfused softmax: memory per rank holds the
gathered K/V and [s/cp x s] scores, not TE's ring/flash footprint.

Which attention a run builds (with_context_parallel, the builder's hook):
- CP 1: the stock module, untouched.
- a GPU with Transformer Engine: TEDotProductAttention does CP itself, with --cp-comm-type passed
  to TransformerConfig (capture_megatron.config.context.te_comm_type).
- the fake-cuda device (GPU kernel set under FakeTensorMode) with TE's flash or fused backend:
  the kernel set's core attention runs TE's ring (p2p) algorithm itself
  (capture_megatron.emulate.gpu.cp); the local spec and TE's unfused backend refuse CP, as they
  do on a GPU.
- otherwise (the CPU kernel set; the local spec on a GPU without TE): AllGatherCPAttention, which
  all-gathers: --cp-comm-type allgather or none; p2p / a2a / a2a+p2p are refused
  (capture_megatron.config.context.check_comm_type): they are TE's algorithms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from capture_megatron.config import ParallelPlan
from capture_megatron.config.context import check_comm_type
from capture_megatron.errors import CaptureError


def with_context_parallel(spec, plan: ParallelPlan, uses_te: bool, emulated: bool = False):
    """The transformer layer `spec` with a core attention that supports `plan.cp` (see the
    module docstring); `uses_te`: the spec is Transformer Engine's (real or the kernel set's);
    `emulated`: the GPU kernel set on fake CUDA (the builder's Backend says)."""
    if plan.cp == 1 or uses_te:
        return spec
    if emulated:
        raise CaptureError(
            f"--context-parallel-size {plan.cp}: Megatron's local attention and Transformer "
            "Engine's unfused backend do not run context parallelism; use --transformer-impl "
            "transformer_engine with --attention-backend flash, fused or auto"
        )
    check_comm_type(plan, uses_te=False)
    attention = spec.submodules.self_attention
    inner = dataclasses.replace(attention.submodules, core_attention=AllGatherCPAttention)
    layer = dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)
    )
    return dataclasses.replace(spec, submodules=layer)


def rank_positions(cp: int, rank: int, chunk: int) -> torch.Tensor:
    """Global positions of the 2 x `chunk` tokens CP rank `rank` holds, in its order: chunk
    `rank` then chunk 2cp-1-rank."""
    first = torch.arange(chunk) + rank * chunk
    second = torch.arange(chunk) + (2 * cp - 1 - rank) * chunk
    return torch.cat([first, second])


@functools.lru_cache(maxsize=64)
def cp_mask(
    cp: int, rank: int, chunk: int, window: tuple[int, int] | None, device: str
) -> torch.Tensor:
    """Boolean mask [1, 1, 2*chunk, 2*cp*chunk] (True: masked) of CP rank `rank`'s queries against
    the all-gathered keys (rank 0's tokens, then rank 1's, ...): causal, or with `window` megatron's
    sliding window (get_sliding_window_causal_mask: a key at distance k - q in [-w0, w1] is
    seen)."""
    q = rank_positions(cp, rank, chunk)[:, None]
    k = torch.cat([rank_positions(cp, j, chunk) for j in range(cp)])[None, :]
    masked = k > q if window is None else (k - q < -window[0]) | (k - q > window[1])
    return masked.view(1, 1, *masked.shape).to(device)


@contextlib.contextmanager
def _cp_hidden(config):
    """DotProductAttention.__init__ asserts context_parallel_size == 1: show it 1 meanwhile."""
    cp = config.context_parallel_size
    config.context_parallel_size = 1
    try:
        yield
    finally:
        config.context_parallel_size = cp


class AllGatherCPAttention(DotProductAttention):
    """megatron's DotProductAttention with context parallelism by all-gathering K and V over the
    CP group and masking with the load-balanced causal (or sliding-window) mask; GQA, RoPE (applied
    before, on each rank's chunks), TP, SP, dropout and selective recompute as the stock module."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        with _cp_hidden(config):
            super().__init__(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
        if attn_mask_type != AttnMaskType.causal:
            raise CaptureError(
                f"context parallelism on the all-gather attention needs a causal mask, not "
                f"{attn_mask_type.name}"
            )
        from megatron.core import parallel_state as ps

        # the context-parallel group K and V are gathered over; this layer's sliding window
        # (left, right), or None: causal
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None else ps.get_context_parallel_group()
        window = self.scale_mask_softmax.window_size
        self.window: tuple[int, int] | None = tuple(window) if window is not None else None
        # the mask passed to the softmax carries causality and the window: the softmax must use
        # it as given (its causal kernel and its window mask assume a square, unsplit sequence)
        self.scale_mask_softmax.window_size = None
        self.scale_mask_softmax.attn_mask_type = AttnMaskType.arbitrary

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ):
        """Attention of this rank's queries [s/cp, b, np, hn] over the whole sequence's keys and
        values (gathered here from [s/cp, b, ng, hn] each); returns [s/cp, b, hp]."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if attention_mask is not None or packed_seq_params is not None:
            raise CaptureError(
                "context parallelism on the all-gather attention takes neither an attention "
                "mask nor packed sequences (it builds the causal mask of its chunks)"
            )
        key = gather_from_sequence_parallel_region(key, True, self.cp_group)
        value = gather_from_sequence_parallel_region(value, True, self.cp_group)
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        mask = cp_mask(cp, rank, query.size(0) // 2, self.window, str(query.device))
        return super().forward(
            query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params
        )
