"""The O(1)-in-layers static-memory layout equals the element-by-element distributed-optimizer
layout."""

import random

import pytest

from capture_megatron.config import DdpOptions
from capture_megatron.config.ddp import DEFAULT_DDP
from capture_megatron.forecast.static import chunk_static, runs_static

BF16_GRADS = DdpOptions(grad_reduce_in_bf16=True)


@pytest.mark.parametrize("seed", range(300))
def test_structured_equals_flat_layout(seed):
    rng = random.Random(seed)
    layer = tuple(
        rng.choice([1, 7, 64, 65, 100, 128, 1000, 4096, 12345]) for _ in range(rng.randint(1, 6))
    )
    pre = tuple(rng.randint(1, 5000) for _ in range(rng.randint(0, 3)))
    post = tuple(rng.randint(1, 5000) for _ in range(rng.randint(0, 3)))
    k, dp = rng.randint(0, 9), rng.choice([1, 2, 3, 4, 8, 12, 64])
    shared = rng.choice([None, "pre" if pre else None, "post" if post else None])
    flat = list(pre) + list(layer) * k + list(post)
    index = {None: None, "pre": 0, "post": len(flat) - 1}[shared]
    for dtype, bf16_grads in (("fp32", False), ("bf16", False), ("bf16", True)):
        for distopt in (False, True):
            ddp = DdpOptions(grad_reduce_in_bf16=bf16_grads)
            want = chunk_static(flat, dtype, dp, distopt, index, ddp)
            got = runs_static(pre, ((layer, k),), post, dtype, dp, distopt, shared, ddp)
            assert got == want, (
                pre,
                layer,
                k,
                post,
                dp,
            )


def test_bf16_gradients_halve_the_buffer_and_the_step_copies_the_shard():
    """--grad-reduce-in-bf16: a bf16 run's gradient buffer holds 2 bytes per element, not fp32's 4;
    params and optimizer state do not change; the elements the optimizer steps (its shard with
    the distributed optimizer) are what megatron-core copies to fp32 before the step."""
    numels = [4096 * 4096, 4096, 11008 * 4096]
    for distopt, dp in ((False, 1), (True, 4)):
        fp32 = chunk_static(numels, "bf16", dp, distopt)
        bf16 = chunk_static(numels, "bf16", dp, distopt, None, BF16_GRADS)
        assert bf16.grads * 2 == fp32.grads and bf16.params == fp32.params
        assert bf16.optimizer == fp32.optimizer and fp32.copies == 0
    copies = chunk_static(numels, "bf16", 4, True, None, BF16_GRADS).copies
    assert copies == pytest.approx(sum(numels), rel=0.01)  # 4 bytes x a quarter of the elements


def _owned_one_by_one(ranges, buckets, dp):
    """The elements of each parameter inside DP rank 0's slices, slice by slice."""
    shards = [(lo, lo + (hi - lo) // dp) for lo, hi in buckets]
    return [
        sum(max(0, min(hi, s_hi) - max(lo, s_lo)) for s_lo, s_hi in shards) for lo, hi in ranges
    ]


@pytest.mark.parametrize("seed", range(20))
def test_owned_elements_match_the_slice_by_slice_count(seed):
    """static._owned counts every parameter's owned elements at once: the same as adding its
    overlap with each slice, on random layouts (parameters spanning several buckets, buckets
    smaller than a parameter, shared embeddings, data-parallel sizes that do not divide)."""
    from capture_megatron.forecast.static import _owned, buffer_layout, layout_of

    rng = random.Random(seed)
    numels = [
        rng.choice([1, 7, 64, 1000, 4096 * rng.randint(1, 50)]) for _ in range(rng.randint(1, 60))
    ]
    dp = rng.choice([1, 2, 3, 8, 64])
    bucket = rng.choice([None, 100, 5000, 40000])
    layout = layout_of("bf16", DEFAULT_DDP, dp, True, bucket)
    ranges, buckets = buffer_layout(numels, layout, rng.choice([None, 0, len(numels) - 1]))
    assert _owned(ranges, buckets, layout.shards) == _owned_one_by_one(
        ranges, buckets, layout.shards
    )
