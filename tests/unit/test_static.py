"""The O(1)-in-layers static-memory layout equals the element-by-element distributed-optimizer
layout."""

import random

import pytest

from capture_megatron.predict.static import chunk_static, runs_static


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
    for dtype in ("fp32", "bf16"):
        for distopt in (False, True):
            want = chunk_static(flat, dtype, dp, distopt, index)
            assert runs_static(pre, ((layer, k),), post, dtype, dp, distopt, shared) == want, (
                pre,
                layer,
                k,
                post,
                dp,
            )
