"""Static memory of a model chunk from its parameter element counts (pure Python).

Megatron-core 0.16.1's rules, which the profiler's measured param/grad/optimizer bytes check:
- DDP keeps gradients in one contiguous buffer per dtype: fp32 when training in bf16
  (grad_reduce_in_fp32, Megatron-LM's default), otherwise (or with --grad-reduce-in-bf16) the
  parameter dtype.
- With the distributed optimizer the buffer is laid out for reduce-scatter: parameters in reverse
  order, each start padded to a multiple of 64 elements, the tied (shared) embedding in a bucket of
  its own, every bucket end padded to a multiple of lcm(DP, 128); the parameters themselves move
  into a param buffer of the same layout, and each DP rank owns a 1/DP slice of every bucket.
- Adam keeps exp_avg and exp_avg_sq in fp32 plus a 4-byte step counter per parameter tensor (per
  owned slice with the distributed optimizer); bf16/fp16 training adds fp32 master weights.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

from capture_megatron.config import dtype_bytes


@dataclass(frozen=True)
class StaticBytes:
    """Persistent bytes of one chunk on one rank."""

    params: int
    """Model parameters (in the param buffer with the distributed optimizer)."""
    grads: int
    """DDP gradient buffer."""
    optimizer: int
    """Adam moments, step counters and fp32 master weights (this rank's shard)."""
    owned: int = 0
    """Parameter elements this rank's optimizer steps (its shard with the distributed
    optimizer)."""


def _pad(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def buffer_layout(
    numels: list[int], dp: int, shared_index: int | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distributed-optimizer buffer: ((start, end) per parameter, (start, end) per bucket)."""
    items: list[Item] = [(numels[i], i == shared_index) for i in reversed(range(len(numels)))]
    placed, buckets, _ = _place(items, dp)
    return [p for p in placed[::-1] if isinstance(p, tuple)], buckets


def _owned(ranges: list[tuple[int, int]], buckets: list[tuple[int, int]], dp: int) -> list[int]:
    """Elements of each parameter that DP rank 0 owns (its 1/dp slice of every bucket)."""
    shards = sorted((b_lo, b_lo + (b_hi - b_lo) // dp) for b_lo, b_hi in buckets)
    starts = [lo for lo, _ in shards]
    owned = []
    for lo, hi in ranges:  # a parameter overlaps the shards from the one starting at or before lo
        total, j = 0, max(bisect.bisect_right(starts, lo) - 1, 0)
        while j < len(shards) and shards[j][0] < hi:
            total += max(0, min(hi, shards[j][1]) - max(lo, shards[j][0]))
            j += 1
        owned.append(total)
    return owned


def chunk_static(
    numels: list[int],
    dtype: str,
    dp: int,
    distributed_optimizer: bool,
    shared_index: int | None = None,
    bf16_grads: bool = False,
) -> StaticBytes:
    """Static bytes of a chunk with parameters of `numels` elements on DP rank 0 (`bf16_grads`: a
    bf16 run's gradient buffer in bf16, --grad-reduce-in-bf16)."""
    pbytes = dtype_bytes(dtype)
    gbytes = 4 if dtype == "bf16" and not bf16_grads else pbytes
    master = 4 if dtype != "fp32" else 0
    if not numels:
        return StaticBytes(0, 0, 0)
    if not distributed_optimizer:
        n = sum(numels)
        return StaticBytes(n * pbytes, n * gbytes, n * (8 + master) + 4 * len(numels), n)
    ranges, buckets = buffer_layout(numels, dp, shared_index)
    total = buckets[-1][1]
    owned = [o for o in _owned(ranges, buckets, dp) if o > 0]
    optimizer = sum(owned) * (8 + master) + 4 * len(owned)
    return StaticBytes(total * pbytes, total * gbytes, optimizer, sum(owned))


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
    items: list[Item], dp: int
) -> tuple[list[tuple[int, int] | _Block], list[tuple[int, int]], int]:
    """buffer_layout for a sequence in buffer order of (numel, shared) singles and (layer, k)
    blocks, in O(parameters of one layer) per block: placements, buckets, and the raw end."""
    divisor = math.lcm(dp, 128)
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
        if shared:
            buckets.append((bucket_start, _pad(start, divisor)))
            bucket_start = start = buckets[-1][1]
            count = 0
    if count:
        buckets.append((bucket_start, _pad(start, divisor)))
    return placed, buckets, start


def _block_overlap(b: _Block, lo: int, hi: int) -> tuple[int, int]:
    """(elements, parameters) of a block inside [lo, hi)."""
    if hi <= lo:
        return 0, 0
    first, last = (lo - b.base) // b.period, (hi - 1 - b.base) // b.period
    full_lo, full_hi = max(0, -(-(lo - b.base) // b.period)), min(b.k, (hi - b.base) // b.period)
    elements = params = 0
    if full_lo < full_hi:
        elements += (full_hi - full_lo) * sum(n for _, n in b.offsets)
        params += (full_hi - full_lo) * len(b.offsets)
    for j in {first, last}:
        if 0 <= j < b.k and not full_lo <= j < full_hi:
            for off, n in b.offsets:
                p_lo = b.base + j * b.period + off
                ov = min(hi, p_lo + n) - max(lo, p_lo)
                if ov > 0:
                    elements, params = elements + ov, params + 1
    return elements, params


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
    bf16_grads: bool = False,
    param_bytes: int = 0,
) -> StaticBytes:
    """chunk_static of the parameters pre + each run's layer repeated + post, in that order
    (shared: 'pre' for pre[0], 'post' for post[-1]), exact and in time independent of the runs'
    lengths; `bf16_grads`: a bf16 run's gradient buffer in bf16 (--grad-reduce-in-bf16);
    `param_bytes`: bytes per parameter element when not the dtype's (1: FP8 parameters, whose
    gradients and master weights are those of the dtype's parameters)."""
    runs = tuple((layer, k) for layer, k in runs if k and layer)
    numels = len(pre) + sum(k * len(layer) for layer, k in runs) + len(post)
    if numels == 0:
        return StaticBytes(0, 0, 0)
    pbytes, master = dtype_bytes(dtype), 4 if dtype != "fp32" else 0
    gbytes = 4 if dtype == "bf16" and not bf16_grads else pbytes
    pbytes = param_bytes or pbytes
    if not distributed_optimizer:
        total = sum(pre) + sum(k * sum(layer) for layer, k in runs) + sum(post)
        return StaticBytes(total * pbytes, total * gbytes, total * (8 + master) + 4 * numels, total)
    items: list[Item] = [(n, shared == "post" and i == 0) for i, n in enumerate(reversed(post))]
    items += [(tuple(reversed(layer)), k) for layer, k in reversed(runs)]
    items += [(n, shared == "pre" and i == len(pre) - 1) for i, n in enumerate(reversed(pre))]
    placed, buckets, _ = _place(items, dp)
    elements = params = 0
    for b_lo, b_hi in buckets:
        lo, hi = b_lo, b_lo + (b_hi - b_lo) // dp
        for p in placed:
            if isinstance(p, _Block):
                e, c = _block_overlap(p, lo, hi)
            else:
                ov = min(hi, p[1]) - max(lo, p[0])
                e, c = max(ov, 0), int(ov > 0)
            elements, params = elements + e, params + c
    total = buckets[-1][1]
    return StaticBytes(
        total * pbytes, total * gbytes, elements * (8 + master) + 4 * params, elements
    )


LayerRun = tuple[tuple[int, ...], tuple[bool, ...], int]
"""(one layer's parameter element counts, per entry whether it is a routed expert's, how many such
layers follow one another)."""


def layer_static(
    pre: tuple[int, ...],
    runs: tuple[LayerRun, ...],
    post: tuple[int, ...],
    dtype: str,
    dp: tuple[int, int],
    distributed_optimizer: bool,
    shared: str | None = None,
    post_expert: tuple[bool, ...] = (),
    bf16_grads: bool = False,
    fp8: tuple[tuple[bool, ...], ...] = (),
) -> StaticBytes:
    """runs_static of a chunk whose layers may hold routed experts (dense and MoE layers in any
    order): DDP keeps the parameters a run's mask marks in a buffer of their own, sharded over the
    expert-data-parallel ranks, the rest over the data-parallel (x context-parallel) ranks. `dp`:
    (data-parallel ranks, expert-data-parallel ranks); `post_expert`: per entry of `post`, whether
    it is a routed expert's (an MTP layer's experts; empty: none is). `fp8`: per run, which of its
    parameters are FP8 (--fp8-param-gather; empty: none); megatron-core groups DDP's buffers by
    (parameter dtype, gradient dtype), so they get 1-byte buffers of their own (an MTP layer's
    weights are counted in bf16)."""
    lows = fp8 or tuple((False,) * len(layer) for layer, _, _ in runs)
    mask = post_expert or (False,) * len(post)
    opt, grads, parts = distributed_optimizer, bf16_grads, []
    for expert, low in ((False, False), (True, False), (False, True), (True, True)):
        part = tuple(
            (tuple(n for n, e, f in zip(lay, ex, fm) if e == expert and f == low), k)
            for (lay, ex, k), fm in zip(runs, lows)
        )
        tail = () if low else tuple(n for n, e in zip(post, mask) if e == expert)
        if not (expert or low):
            parts.append(runs_static(pre, part, tail, dtype, dp[0], opt, shared, grads))
        elif any(layer for layer, _ in part) or tail:
            group = dp[1] if expert else dp[0]
            parts.append(runs_static((), part, tail, dtype, group, opt, None, grads, int(low)))
    return StaticBytes(
        *(sum(getattr(p, f) for p in parts) for f in ("params", "grads", "optimizer", "owned"))
    )
