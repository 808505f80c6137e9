"""Static memory of a model chunk from its parameter element counts (pure Python).

Megatron-core 0.16.1's rules, which the profiler's measured param/grad/optimizer bytes check:
- DDP keeps gradients in one contiguous buffer per dtype: fp32 when training in bf16
  (grad_reduce_in_fp32, as Megatron-LM forces), otherwise the parameter dtype.
- With the distributed optimizer the buffer is laid out for reduce-scatter: parameters in reverse
  order, each start padded to a multiple of 64 elements, the tied (shared) embedding in a bucket of
  its own, every bucket end padded to a multiple of lcm(DP, 128); the parameters themselves move into
  a param buffer of the same layout, and each DP rank owns a 1/DP slice of every bucket.
- Adam keeps exp_avg and exp_avg_sq in fp32 plus a 4-byte step counter per parameter tensor (per
  owned slice with the distributed optimizer); bf16/fp16 training adds fp32 master weights.
"""
from __future__ import annotations

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


def _pad(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def buffer_layout(numels: list[int], dp: int, shared_index: int | None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distributed-optimizer buffer: ((start, end) per parameter, (start, end) per bucket)."""
    ranges = [(0, 0)] * len(numels)
    buckets, bucket_start, start, count = [], 0, 0, 0
    divisor = math.lcm(dp, 128)
    for i in reversed(range(len(numels))):
        start = _pad(start, 64)
        shared = i == shared_index
        if shared and count:
            buckets.append((bucket_start, _pad(start, divisor)))
            bucket_start = start = buckets[-1][1]
            count = 0
        ranges[i] = (start, start + numels[i])
        count += 1
        start += numels[i]
        if shared:
            buckets.append((bucket_start, _pad(start, divisor)))
            bucket_start = start = buckets[-1][1]
            count = 0
    if count:
        buckets.append((bucket_start, _pad(start, divisor)))
    return ranges, buckets


def _owned(ranges, buckets, dp: int) -> list[int]:
    """Elements of each parameter that DP rank 0 owns (its 1/dp slice of every bucket)."""
    owned = []
    for lo, hi in ranges:
        total = 0
        for b_lo, b_hi in buckets:
            shard_hi = b_lo + (b_hi - b_lo) // dp
            total += max(0, min(hi, shard_hi) - max(lo, b_lo))
        owned.append(total)
    return owned


def chunk_static(numels: list[int], dtype: str, dp: int, distributed_optimizer: bool,
                 shared_index: int | None = None) -> StaticBytes:
    """Static bytes of a chunk with parameters of `numels` elements on DP rank 0."""
    pbytes = dtype_bytes(dtype)
    gbytes = 4 if dtype == "bf16" else pbytes
    master = 4 if dtype != "fp32" else 0
    if not numels:
        return StaticBytes(0, 0, 0)
    if not distributed_optimizer:
        n = sum(numels)
        return StaticBytes(n * pbytes, n * gbytes, n * (8 + master) + 4 * len(numels))
    ranges, buckets = buffer_layout(numels, dp, shared_index)
    total = buckets[-1][1]
    owned = [o for o in _owned(ranges, buckets, dp) if o > 0]
    return StaticBytes(total * pbytes, total * gbytes, sum(owned) * (8 + master) + 4 * len(owned))
