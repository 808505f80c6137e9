"""Megatron-FSDP's bytes for one model chunk (capture_megatron.features.fsdp has megatron-core
0.16.1's rules): its persistent shards and whole buffers, the double buffers, and what its
forward and backward add on top of the activations -- the transformer layers gathered (the one
running and those prefetched), the non-layer parameters gathered for the whole forward and
backward, and the whole gradient buckets accumulated until their reduce-scatter is done. Pure
Python.

The passes are walked layer by layer: at layer j of k the forward has saved j of its layers'
activations and the backward still holds j + 1 (the chunk's profiled peaks, less the saved
activations of the layers not yet run or already done), beside what Megatron-FSDP holds there;
the pass's peak is the largest of them."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import DdpOptions, ParallelPlan, dtype_bytes, versions
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.forecast.static import LayerRun, StaticBytes


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m if n else 0


@dataclass(frozen=True)
class Layout:
    """A chunk's parameters as Megatron-FSDP buckets them: element counts, whole (padded)."""

    units: tuple[tuple[int, int], ...]
    """Per transformer layer, in forward order: (dense, expert) elements of its buckets (the
    layers are FSDP units only with optim_grads_params; otherwise they share the ends' groups)."""
    ends: tuple[int, int]
    """(dense, expert) elements of the non-unit buckets (embedding, final norm, MTP, output)."""
    tensors: int
    """Parameter tensors."""


def layout_of(
    pre: tuple[int, ...],
    runs: tuple[LayerRun, ...],
    post: tuple[int, ...],
    post_expert: tuple[bool, ...],
    ranks: tuple[int, int],
) -> Layout:
    """The chunk's buckets: each layer's dense and expert parameters, and the rest, each padded
    to a multiple of its ranks (`ranks`: dense, expert)."""
    units: list[tuple[int, int]] = []
    tensors = len(pre) + len(post)
    for numels, expert, count in runs:
        dense = sum(n for n, e in zip(numels, expert) if not e)
        routed = sum(n for n, e in zip(numels, expert) if e)
        units += [(_pad(dense, ranks[0]), _pad(routed, ranks[1]))] * count
        tensors += len(numels) * count
    mask = post_expert or (False,) * len(post)
    routed_ends = sum(n for n, e in zip(post, mask) if e)
    dense_ends = sum(pre) + sum(post) - routed_ends
    return Layout(tuple(units), (_pad(dense_ends, ranks[0]), _pad(routed_ends, ranks[1])), tensors)


@dataclass(frozen=True)
class Passes:
    """A chunk's profiled pass peaks (above the live bytes before them) and its saved
    activations per micro-batch."""

    forward: float
    """ChunkCost.forward."""
    backward: float
    """ChunkCost.backward."""
    saved: float
    """What one micro-batch saves in the chunk (beyond its received input)."""


@dataclass(frozen=True)
class FsdpChunk:
    """What Megatron-FSDP makes of one chunk on one rank."""

    static: StaticBytes
    """Model weights, gradients, main weights and optimizer state, gradient copies at the step."""
    buffers: float
    """What the rank keeps through every forward and backward: the double buffers (two layers'
    weights and gradients, for good) and the non-unit weights gathered whole (from their first
    forward to the step; counted with the static bytes, so also at the step, which they leave
    just before it)."""
    forward: float
    """The forward's peak above the live bytes before it, the layers gathered included."""
    backward: float
    """The backward's peak above the live bytes before it, the layers gathered and the gradient
    buckets not yet freed included."""


def fsdp_chunk(
    fsdp: Fsdp,
    ddp: DdpOptions,
    dtype: str,
    layout: Layout,
    dp: tuple[int, int],
    kind: str,
    bucket_size: int | None,
    passes: Passes,
    whole_moments: tuple[int, int] | None = None,
) -> FsdpChunk:
    """Megatron-FSDP's bytes of a chunk laid out as `layout` over `dp` (data x context-parallel,
    expert-data-parallel) ranks; `kind`: which ends the chunk holds (first, middle, last, only);
    `bucket_size`: DDP's (the non-unit buckets' split; the communication unit's default);
    `whole_moments`: (TP, expert TP) when Transformer Engine 2.10 / 2.11's FusedAdam keeps each
    Adam moment whole (`torch.empty(param.shape)` of the DTensor's global shape: gathered over TP,
    not sharded), else None."""
    pbytes, gbytes = dtype_bytes(dtype), dtype_bytes(ddp.grad_dtype(dtype))
    inner = max(dp[0] // ddp.num_distributed_optimizer_instances, 1)
    outer = dp[0] if fsdp.outer_dp_sharding_strategy == "optim" else inner
    weights, state, grads = fsdp.sharded()
    groups = [(d, inner, outer) for d, _ in layout.units] + [(layout.ends[0], inner, outer)]
    groups += [(e, dp[1], dp[1]) for _, e in layout.units] + [(layout.ends[1], dp[1], dp[1])]
    kept = sum(n // r if weights else n for n, r, _ in groups)
    owned = sum(n // o if state else n for n, _, o in groups)
    gkept = sum(n // r if grads else n for n, r, _ in groups)
    tensors = layout.tensors // (dp[0] if state else 1) + len(groups) * int(state)
    static = StaticBytes(
        params=kept * pbytes,
        grads=gkept * gbytes,
        optimizer=owned * 4 + _moments(groups, state, whole_moments) + 4 * tensors,
        copies=owned * 4 if gbytes != 4 else 0,  # update_main_grads: .to(float32)
        largest=max((n // o if state else n for n, _, o in groups), default=0),
    )
    units = [d + e for d, e in layout.units]
    double = _double_buffered(layout) if fsdp.double_buffer else None
    buffers = 2.0 * (pbytes + gbytes) * units[double] if double is not None else 0.0
    gathered = float(sum(layout.ends) * pbytes) if fsdp.units else 0.0  # kept until the step
    average = sum(units) // max(len(units), 1)
    unit = fsdp.communication_unit(average, bucket_size)
    windows = _windows(fsdp, layout, double, unit // 2)
    held = _gradients(fsdp, layout, double, kind, unit)
    forward, backward = _walk(passes, windows, held, pbytes, gbytes)
    return FsdpChunk(static, buffers + gathered, forward, backward)


def _moments(groups: list[tuple[int, int, int]], state: bool, whole: tuple[int, int] | None) -> int:
    """Bytes of Adam's two fp32 moments: per element of the main-weight shards (`groups`: (dense
    or expert elements, weight ranks, state ranks), the dense ones first), or with `whole` (TP,
    expert TP) per element of each parameter's global shape. Every parameter is counted as split
    over TP: the replicated ones (norms, biases, the router) are whole already, an upper bound by
    8 (TP - 1) bytes per such element."""
    if whole is None:
        return 8 * sum(n // o if state else n for n, _, o in groups)
    half = len(groups) // 2
    dense, expert = sum(n for n, _, _ in groups[:half]), sum(n for n, _, _ in groups[half:])
    return 8 * (dense * whole[0] + expert * whole[1])


def _double_buffered(layout: Layout) -> int | None:
    """Index of a layer whose layout the double buffers serve: the most common one (the first
    such layer); None without layers."""
    if not layout.units:
        return None
    counts = {u: layout.units.count(u) for u in layout.units}
    best = max(counts.values())
    return next(i for i, u in enumerate(layout.units) if counts[u] == best)


def _windows(
    fsdp: Fsdp, layout: Layout, double: int | None, prefetch: int
) -> tuple[list[int], list[int]]:
    """(forward, backward) elements of the layers gathered outside the double buffers while layer
    j runs: j and the next layers (the previous ones in the backward) prefetched until the
    prefetched elements reach `prefetch` (at most one more with double buffers); nothing
    without units."""
    k = len(layout.units)
    if not fsdp.units:
        return [0] * k, [0] * k
    sizes = [d + e for d, e in layout.units]
    kept = layout.units[double] if double is not None else None
    own = [0 if layout.units[i] == kept else sizes[i] for i in range(k)]

    def window(j: int, step: int) -> int:
        total, ahead, i = own[j], 0, j + step
        while 0 <= i < k and ahead < prefetch and (double is None or abs(i - j) < 2):
            total, ahead, i = total + own[i], ahead + sizes[i], i + step
        return total

    return [window(j, 1) for j in range(k)], [window(j, -1) for j in range(k)]


def _gradients(
    fsdp: Fsdp, layout: Layout, double: int | None, kind: str, capacity: int
) -> list[int]:
    """Elements of whole gradient buckets alive while layer j's backward runs (outside the
    double buffers): the non-unit buckets (whole through the backward when they end it, queued
    when the output layer's complete first), the layers done whose reduce-scatter queue has not
    passed `capacity`, and layer j's; with sharded gradients but no units, every bucket from the
    first gradient on; nothing when gradients are not sharded."""
    k = len(layout.units)
    if not fsdp.sharded()[2]:
        return [0] * k
    ends = sum(layout.ends)
    if not fsdp.units:
        return [ends + sum(d + e for d, e in layout.units)] * k
    kept = layout.units[double] if double is not None else None
    own = [0 if u == kept else sum(u) for u in layout.units]
    queue = [ends] if kind == "last" else []  # the output layer's buckets complete first
    alive = 0 if kind == "last" else ends
    held = [0] * k
    for j in range(k - 1, -1, -1):
        held[j] = alive + sum(queue) + own[j]
        while sum(queue) > capacity:
            queue.pop(0)
        queue.append(own[j])
    return held


def _walk(
    passes: Passes,
    windows: tuple[list[int], list[int]],
    held: list[int],
    pbytes: int,
    gbytes: int,
) -> tuple[float, float]:
    """(forward, backward) peaks: at each layer j of k, the pass's profiled peak less the saved
    activations of the k - 1 - j layers after j (not yet run in the forward, already done and
    freed in the backward), plus the layers gathered and, in the backward, the gradient buckets
    alive."""
    k = len(held)
    if not k:
        return passes.forward, passes.backward
    per = passes.saved / k
    fwd = [passes.forward - per * (k - 1 - j) + pbytes * windows[0][j] for j in range(k)]
    bwd = [
        passes.backward - per * (k - 1 - j) + pbytes * windows[1][j] + gbytes * held[j]
        for j in range(k)
    ]
    return max(fwd), max(bwd)


Parts = tuple[tuple[int, ...], tuple[LayerRun, ...], tuple[int, ...], tuple[bool, ...]]
"""A chunk's parameters as forecast.static.layer_static takes them: (pre, runs, post, which of
post are routed experts')."""


def chunk_state(
    ddp: DdpOptions,
    dtype: str,
    parts: Parts,
    dp: tuple[int, int],
    kind: str,
    bucket_size: int | None,
    passes: Passes,
    whole_moments: tuple[int, int] | None = None,
) -> FsdpChunk:
    """fsdp_chunk of a chunk given as `parts` (the settings in `ddp.fsdp`)."""
    pre, runs, post, post_expert = parts
    inner = max(dp[0] // ddp.num_distributed_optimizer_instances, 1)
    layout = layout_of(pre, runs, post, post_expert, (inner, dp[1]))
    return fsdp_chunk(ddp.fsdp, ddp, dtype, layout, dp, kind, bucket_size, passes, whole_moments)


def moments_note(plan: ParallelPlan, on_gpu: bool) -> str:
    """What a Megatron-FSDP plan says when the GPU run's Transformer Engine keeps the Adam moments
    whole ('' otherwise)."""
    if not (on_gpu and plan.ddp.fsdp.enabled and plan.ddp.optimizer.optimizer == "adam"):
        return ""
    te = versions.transformer_engine()
    if te not in versions.TE_FULL_SIZE_MOMENTS:
        return ""
    return (
        f"Megatron-FSDP with Transformer Engine {te[0]}.{te[1]} (without it installed: the newest "
        f"the installed megatron-core admits; {versions.TE_ENV} names yours): its FusedAdam keeps "
        f"both Adam moments of every parameter whole, gathered over TP {plan.tp} and not sharded "
        "(8 bytes x TP per element of the rank's parameters, in the forecast); Transformer "
        "Engine 2.12 shards them (TE PR #2535)"
    )
