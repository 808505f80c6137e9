"""Static memory of a model chunk from its parameter element counts (pure Python).

Megatron-core 0.16.1's rules, which the profiler's measured param/grad/optimizer bytes check
(docs/MEMORY_MODEL.md, "Static bytes", has the bytes per parameter of every setting):
- DDP keeps gradients in one contiguous buffer per dtype (DdpOptions.grad_dtype: fp32 when
  training in bf16 unless --grad-reduce-in-bf16, Megatron-LM's rule), routed experts' in another.
- With the distributed optimizer the buffer is laid out for reduce-scatter: parameters in reverse
  order, each start padded to a multiple of 64 elements, the tied (shared) embedding in a bucket of
  its own, a new bucket once one holds --ddp-bucket-size elements (first stage, first chunk, with
  --overlap-grad-reduce), every bucket end padded to a multiple of lcm(R, 128) (lcm(R, 128, 2^16)
  with --ddp-pad-buckets-for-high-nccl-busbw), R = DP x CP / --num-distributed-optimizer-instances
  ranks; the parameters move into a param buffer of the same layout, and each of the R ranks owns
  a 1/R slice of every bucket.
- Adam keeps exp_avg and exp_avg_sq in fp32 plus a 4-byte step counter per parameter tensor (per
  owned slice with the distributed optimizer); bf16/fp16 training adds fp32 master weights. The
  precision-aware optimizer (Transformer Engine's FusedAdam) keeps the moments and master weights
  in their own dtypes, an fp32 scale per tensor for every state that is not fp32, and no step
  counter.
- At the optimizer step the mixed-precision optimizers copy 16-bit gradients to fp32 (`.float()`,
  alive until the next iteration's zero_grad); TE's FusedAdam unscales every state that is not
  fp32 to a fresh fp32 copy for the whole step (StaticBytes.copies).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from capture_megatron.config import DdpOptions, dtype_bytes
from capture_megatron.config.ddp import DEFAULT_DDP, STATE_BYTES
from capture_megatron.features.optimizer_offload import (
    HOST_BYTES,
    HOST_STEP_BYTES,
    offloaded,
    offloaded_slices,
)


@dataclass(frozen=True)
class StaticBytes:
    """Persistent bytes of one chunk on one rank."""

    params: int
    """Model parameters (in the param buffer with the distributed optimizer)."""
    grads: int
    """DDP gradient buffer."""
    optimizer: int
    """Adam moments, step counters or scales, and master weights (this rank's shard)."""
    copies: int = 0
    """Bytes the optimizer step allocates on top for this chunk's parameters: fp32 copies of 16-bit
    gradients, or the precision-aware optimizer's fp32 copies of its 16/8-bit states."""
    largest: int = 0
    """Elements of the largest slice of one parameter this rank's optimizer updates."""
    host: int = 0
    """Host bytes (--optimizer-cpu-offload: what HybridDeviceOptimizer keeps on the host for
    the slices it moved there; capture_megatron.features.optimizer_offload)."""
    owned: int = 0
    """Elements this rank's optimizer updates on the device (its shard with the distributed
    optimizer, less what --optimizer-cpu-offload moves to the host)."""


@dataclass(frozen=True)
class Layout:
    """How one gradient buffer and its optimizer state are kept: bytes per element and the
    distributed optimizer's sharding."""

    param: int
    """Bytes per parameter element."""
    grad: int
    """Bytes per gradient-buffer element."""
    state: int
    """Optimizer bytes per owned element (moments and master weights)."""
    per_tensor: int
    """Optimizer bytes per owned parameter tensor (Adam's step counter, or FusedAdam's scales)."""
    copies: int
    """Step-time bytes per owned element."""
    shards: int
    """Ranks the distributed optimizer shards the buffer over (1 without it)."""
    distributed: bool
    """Laid out for the distributed optimizer (padded, sharded)."""
    divisor: int = 128
    """Bucket ends are padded to a multiple of this (distributed optimizer)."""
    bucket_size: int | None = None
    """Elements after which a new bucket starts (None: one bucket, bar the shared embedding)."""
    offload: float | None = None
    """--optimizer-cpu-offload: the fraction of the owned elements updated on the host (None:
    no offload); `state`, `per_tensor` and `copies` are then those of the elements left on the
    device."""


def layout_of(
    dtype: str,
    ddp: DdpOptions,
    dp: int,
    distributed_optimizer: bool,
    bucket_size: int | None = None,
    param_bytes: int = 0,
) -> Layout:
    """The Layout of a buffer of `dtype` parameters over `dp` data (x context) parallel ranks
    (`param_bytes`: bytes per parameter element when not the dtype's, e.g. 1 for low-precision
    parameters)."""
    pbytes = dtype_bytes(dtype)
    gbytes = dtype_bytes(ddp.grad_dtype(dtype))
    shards = ddp.shard_ranks(dp) if distributed_optimizer else 1
    if ddp.optimizer_cpu_offload:  # HybridDeviceOptimizer's device side: fp32 master, moments
        state, per_tensor = 8 + (4 if dtype != "fp32" else 0), 0
        copies = 4 if dtype != "fp32" and gbytes != 4 else 0
    elif ddp.use_precision_aware_optimizer:
        state, per_tensor, copies = _fused_adam(dtype, ddp)
    else:
        state, per_tensor = 8 + (4 if dtype != "fp32" else 0), 4
        copies = 4 if dtype != "fp32" and gbytes != 4 else 0
    pad = 2**16 if ddp.ddp_pad_buckets_for_high_nccl_busbw else 1
    return Layout(
        param=param_bytes or pbytes,
        grad=gbytes,
        state=state,
        per_tensor=per_tensor,
        copies=copies,
        shards=shards,
        distributed=distributed_optimizer,
        divisor=math.lcm(shards, 128, pad),
        bucket_size=bucket_size if distributed_optimizer else None,
        offload=ddp.optimizer_offload_fraction if ddp.optimizer_cpu_offload else None,
    )


def _fused_adam(dtype: str, ddp: DdpOptions) -> tuple[int, int, int]:
    """(bytes per owned element, per owned tensor, copied at the step) of Transformer Engine's
    FusedAdam as megatron-core builds it for the precision-aware optimizer: master weights always
    (fp32 parameters too); bf16 parameters with fp32 master weights keep the int16 remainder
    (store_param_remainders, on with TE >= 2.1); every state that is not fp32 has an fp32 [1]
    scale and is unscaled to an fp32 copy for the step."""
    moments = [STATE_BYTES[ddp.exp_avg_dtype], STATE_BYTES[ddp.exp_avg_sq_dtype]]
    if ddp.main_params_dtype == "fp16":
        master, scaled = 2, True
    else:
        master, scaled = (2 if dtype == "bf16" else 4), False  # the remainder is int16, unscaled
    low = sum(b != 4 for b in moments) + int(scaled)
    return sum(moments) + master, 4 * low, 4 * low


def _pad(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def buffer_layout(
    numels: list[int], layout: Layout, shared_index: int | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distributed-optimizer buffer: ((start, end) per parameter, (start, end) per bucket)."""
    items: list[Item] = [(numels[i], i == shared_index) for i in reversed(range(len(numels)))]
    placed, buckets, _ = _place(items, layout)
    return [p for p in placed[::-1] if isinstance(p, tuple)], buckets


def _owned(ranges: list[tuple[int, int]], buckets: list[tuple[int, int]], dp: int) -> list[int]:
    """Elements of each parameter that DP rank 0 owns (its 1/dp slice of every bucket): the
    slices' elements below a parameter's end less those below its start (the slices are disjoint:
    one per bucket), for all parameters at once (an MoE chunk has thousands)."""
    shards = sorted((b_lo, b_lo + (b_hi - b_lo) // dp) for b_lo, b_hi in buckets)
    starts = np.array([lo for lo, _ in shards], dtype=np.int64)
    sizes = np.array([hi - lo for lo, hi in shards], dtype=np.int64)
    below = np.concatenate(([0], np.cumsum(sizes)))  # elements of the slices before slice j

    def covered(x: np.ndarray) -> np.ndarray:  # slice elements below each x
        j = np.searchsorted(starts, x, side="right") - 1  # the last slice starting at or before x
        at = np.maximum(j, 0)
        return np.where(j >= 0, below[at] + np.clip(x - starts[at], 0, sizes[at]), 0)

    bounds = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    return [int(n) for n in covered(bounds[:, 1]) - covered(bounds[:, 0])]


def _bytes(layout: Layout, total: int, elements: int, tensors: int, largest: int) -> StaticBytes:
    """StaticBytes of a buffer of `total` elements of which this rank owns `elements` in
    `tensors` parameter tensors, at most `largest` of one (with --optimizer-cpu-offload, those
    HybridDeviceOptimizer moves to the host cost host bytes instead)."""
    moved = moved_slices = 0
    if layout.offload is not None:
        moved = offloaded(layout.offload, elements)
        moved_slices = offloaded_slices(layout.offload, tensors)
    kept, kept_slices = elements - moved, tensors - moved_slices
    return StaticBytes(
        total * layout.param,
        total * layout.grad,
        kept * layout.state + kept_slices * layout.per_tensor,
        kept * layout.copies,
        largest,
        moved * HOST_BYTES + moved_slices * HOST_STEP_BYTES,
        kept,
    )


def chunk_static(
    numels: list[int],
    dtype: str,
    dp: int,
    distributed_optimizer: bool,
    shared_index: int | None = None,
    ddp: DdpOptions = DEFAULT_DDP,
    bucket_size: int | None = None,
    param_bytes: int = 0,
) -> StaticBytes:
    """Static bytes of a chunk with parameters of `numels` elements on DP rank 0 (`dp`: the
    data x context parallel ranks; `bucket_size`: DDP's, where it buckets; `param_bytes`: as
    layout_of)."""
    layout = layout_of(dtype, ddp, dp, distributed_optimizer, bucket_size, param_bytes)
    if not numels:
        return StaticBytes(0, 0, 0)
    if not distributed_optimizer:
        return _bytes(layout, sum(numels), sum(numels), len(numels), max(numels))
    ranges, buckets = buffer_layout(numels, layout, shared_index)
    owned = [o for o in _owned(ranges, buckets, layout.shards) if o > 0]
    return _bytes(layout, buckets[-1][1], sum(owned), len(owned), max(owned, default=0))


@dataclass(frozen=True)
class _Block:
    """k repeats of a layer placed from `base`, one layer every `period` elements."""

    base: int
    period: int
    k: int
    offsets: tuple[tuple[int, int], ...]  # (offset in the layer, numel) per parameter


Item = tuple[int, bool] | tuple[tuple[int, ...], int]
"""A buffer item: (numel, shared) for one parameter, or (layer numels, k) for k identical layers."""


def _place(
    items: list[Item], layout: Layout
) -> tuple[list[tuple[int, int] | _Block], list[tuple[int, int]], int]:
    """buffer_layout for a sequence in buffer order of (numel, shared) singles and (layer, k)
    blocks, in O(parameters of one layer) per block: placements, buckets, and the raw end (blocks
    only without a bucket size: a bucket may end inside one)."""
    divisor, size = layout.divisor, layout.bucket_size
    placed: list[tuple[int, int] | _Block] = []
    buckets: list[tuple[int, int]] = []
    bucket_start, start, count = 0, 0, 0
    for item in items:
        start = _pad(start, 64)
        if isinstance(item[0], tuple):  # a block of identical layers (k >= 1), never shared
            layer, k = item
            offsets: list[tuple[int, int]] = []
            off = 0
            for n in layer:
                offsets.append((off, n))
                off = _pad(off + n, 64)
            placed.append(_Block(start, off, k, tuple(offsets)))
            start += (k - 1) * off + offsets[-1][0] + offsets[-1][1]
            count += k * len(layer)
            continue
        n, shared = item[0], bool(item[1])
        if shared and count:
            buckets.append((bucket_start, _pad(start, divisor)))
            bucket_start = start = buckets[-1][1]
            count = 0
        placed.append((start, start + n))
        count, start = count + 1, start + n
        if shared or (size is not None and start - bucket_start >= size):
            buckets.append((bucket_start, _pad(start, divisor)))
            bucket_start = start = buckets[-1][1]
            count = 0
    if count:
        buckets.append((bucket_start, _pad(start, divisor)))
    return placed, buckets, start


def _block_overlap(b: _Block, lo: int, hi: int) -> tuple[int, int, int]:
    """(elements, parameters, the most elements of one parameter) of a block inside [lo, hi)."""
    if hi <= lo:
        return 0, 0, 0
    first, last = (lo - b.base) // b.period, (hi - 1 - b.base) // b.period
    full_lo, full_hi = max(0, -(-(lo - b.base) // b.period)), min(b.k, (hi - b.base) // b.period)
    elements = params = most = 0
    if full_lo < full_hi:
        elements += (full_hi - full_lo) * sum(n for _, n in b.offsets)
        params += (full_hi - full_lo) * len(b.offsets)
        most = max(n for _, n in b.offsets)
    for j in {first, last}:
        if 0 <= j < b.k and not full_lo <= j < full_hi:
            for off, n in b.offsets:
                p_lo = b.base + j * b.period + off
                ov = min(hi, p_lo + n) - max(lo, p_lo)
                if ov > 0:
                    elements, params, most = elements + ov, params + 1, max(most, ov)
    return elements, params, most


Run = tuple[tuple[int, ...], int]
"""(one layer's parameter element counts, how many such layers follow one another)."""


@functools.lru_cache(maxsize=65536)
def runs_static(
    pre: tuple[int, ...],
    runs: tuple[Run, ...],
    post: tuple[int, ...],
    dtype: str,
    dp: int,
    distributed_optimizer: bool,
    shared: str | None = None,
    ddp: DdpOptions = DEFAULT_DDP,
    bucket_size: int | None = None,
    param_bytes: int = 0,
) -> StaticBytes:
    """chunk_static of the parameters pre + each run's layer repeated + post, in that order
    (shared: 'pre' for pre[0], 'post' for post[-1]), exact and, without a bucket size, in time
    independent of the runs' lengths; `param_bytes`: bytes per parameter element when not the
    dtype's (1: low-precision parameters, whose gradients and master weights are those of the
    dtype's parameters)."""
    runs = tuple((layer, k) for layer, k in runs if k and layer)
    numels = len(pre) + sum(k * len(layer) for layer, k in runs) + len(post)
    if numels == 0:
        return StaticBytes(0, 0, 0)
    layout = layout_of(dtype, ddp, dp, distributed_optimizer, bucket_size, param_bytes)
    if not distributed_optimizer:
        total = sum(pre) + sum(k * sum(layer) for layer, k in runs) + sum(post)
        most = max((*pre, *post, *(n for layer, _ in runs for n in layer)))
        return _bytes(layout, total, total, numels, most)
    if layout.bucket_size is not None:  # buckets may end inside a run: lay it out element-wise
        flat = list(pre) + [n for layer, k in runs for n in layer * k] + list(post)
        index = {"pre": 0, "post": len(flat) - 1}.get(shared or "")
        return chunk_static(flat, dtype, dp, True, index, ddp, bucket_size, param_bytes)
    items: list[Item] = [(n, shared == "post" and i == 0) for i, n in enumerate(reversed(post))]
    items += [(tuple(reversed(layer)), k) for layer, k in reversed(runs)]
    items += [(n, shared == "pre" and i == len(pre) - 1) for i, n in enumerate(reversed(pre))]
    placed, buckets, _ = _place(items, layout)
    elements = params = largest = 0
    for b_lo, b_hi in buckets:
        lo, hi = b_lo, b_lo + (b_hi - b_lo) // layout.shards
        for p in placed:
            if isinstance(p, _Block):
                e, c, m = _block_overlap(p, lo, hi)
            else:
                ov = min(hi, p[1]) - max(lo, p[0])
                e, c, m = max(ov, 0), int(ov > 0), max(ov, 0)
            elements, params, largest = elements + e, params + c, max(largest, m)
    return _bytes(layout, buckets[-1][1], elements, params, largest)


LayerRun = tuple[tuple[int, ...], tuple[bool, ...], int]
"""(one layer's parameter element counts, per entry whether it is a routed expert's, how many such
layers follow one another)."""


@functools.lru_cache(maxsize=1 << 16)
def layer_static(
    pre: tuple[int, ...],
    runs: tuple[LayerRun, ...],
    post: tuple[int, ...],
    dtype: str,
    dp: tuple[int, int],
    distributed_optimizer: bool,
    shared: str | None = None,
    post_expert: tuple[bool, ...] = (),
    ddp: DdpOptions = DEFAULT_DDP,
    bucket_size: int | None = None,
    low_precision: tuple[tuple[bool, ...], ...] = (),
) -> StaticBytes:
    """runs_static of a chunk whose layers may hold routed experts (dense and MoE layers in any
    order): DDP keeps the parameters a run's mask marks in a buffer of their own, sharded over the
    expert-data-parallel ranks, the rest over the data-parallel (x context-parallel) ranks. `dp`:
    (data-parallel ranks, expert-data-parallel ranks); `post_expert`: per entry of `post`, whether
    it is a routed expert's (an MTP layer's experts; empty: none is). `low_precision`: per run,
    which of its parameters are 1-byte low-precision ones (empty: none); megatron-core groups DDP's
    buffers by (parameter dtype, gradient dtype), so they get 1-byte buffers of their own (an MTP
    layer's weights are counted in bf16). Memoised: a search costs the same chunk at every
    recompute count, which does not change its static bytes."""
    lows = low_precision or tuple((False,) * len(layer) for layer, _, _ in runs)
    mask = post_expert or (False,) * len(post)
    opt, parts = distributed_optimizer, []
    for expert, low in ((False, False), (True, False), (False, True), (True, True)):
        part = tuple(
            (tuple(n for n, e, f in zip(lay, ex, fm) if e == expert and f == low), k)
            for (lay, ex, k), fm in zip(runs, lows)
        )
        tail = () if low else tuple(n for n, e in zip(post, mask) if e == expert)
        if not (expert or low):
            parts.append(runs_static(pre, part, tail, dtype, dp[0], opt, shared, ddp, bucket_size))
        elif any(layer for layer, _ in part) or tail:
            group = dp[1] if expert else dp[0]
            parts.append(
                runs_static((), part, tail, dtype, group, opt, None, ddp, bucket_size, int(low))
            )
    return StaticBytes(
        params=sum(p.params for p in parts),
        grads=sum(p.grads for p in parts),
        optimizer=sum(p.optimizer for p in parts),
        copies=sum(p.copies for p in parts),
        largest=max(p.largest for p in parts),
        host=sum(p.host for p in parts),
        owned=sum(p.owned for p in parts),
    )
