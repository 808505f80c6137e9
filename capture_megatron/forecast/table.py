"""Rank peaks in bulk: one pipeline rank's predicted peak for every split of up to `limit` layers
per chunk, as a numpy array, bit for bit what rank_memory computes one split at a time.

The partitioner asks for thousands of splits of each plan (every total, every way to spread it over
a rank's chunks); one table costs a few array operations over all of the schedule's moments at once
instead of a Python loop per split. Additions happen in rank_memory's order, so the numbers are
identical (sums of byte counts below 2^53 are exact in float64). Pure Python + numpy."""

from __future__ import annotations

import numpy as np

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.forecast import overlap
from capture_megatron.forecast.chunkmemo import cached_chunk
from capture_megatron.forecast.chunks import chunk_kind
from capture_megatron.forecast.cuda_graphs import graph_buffer_table
from capture_megatron.forecast.layers import Layers
from capture_megatron.forecast.ranks import deferral, plan_states


def _along(values: list[float], axis: int, ndim: int) -> np.ndarray:
    """`values` as an array laid along `axis` of an `ndim`-dimensional table (size 1 elsewhere)."""
    shape = [1] * ndim
    shape[axis] = len(values)
    return np.asarray(values, dtype=np.float64).reshape(shape)


FIELDS = (
    "params",
    "grads",
    "optimizer",
    "buffers",
    "step",
    "inflight",
    "input_bytes",
    "retained",
    "retained_grad",
    "routing_state",
    "step_copies",
    "step_alone",
    "offload_kept",
)
"""The ChunkCost fields a table reads; forward and backward are read as input + forward and
backward."""


def _chunk_arrays(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    v: int,
    limit: int,
    cache: dict | None,
) -> dict[str, np.ndarray]:
    """Chunk v's cost fields for 0..limit layers, as arrays along axis v (memoised in `cache` by
    what they depend on: kind, recompute count, limit)."""
    n = plan.recompute.layers_on(pp_rank) if plan.recompute.granularity == "full" else 0
    key = ("table", chunk_kind(plan, pp_rank, v), n, v, limit)
    if cache is not None and key in cache:
        return cache[key]
    costs = [
        cached_chunk(layers, shape, plan, pp_rank, v, layers.chunk(None, k), cache)
        for k in range(limit + 1)
    ]
    out = {name: _along([getattr(c, name) for c in costs], v, plan.vpp) for name in FIELDS}
    out["forward"] = out["input_bytes"] + _along([c.forward for c in costs], v, plan.vpp)
    out["backward"] = _along([c.backward for c in costs], v, plan.vpp)
    out["layers"] = _along([float(c.layers) for c in costs], v, plan.vpp)
    if cache is not None:
        cache[key] = out
    return out


def _merged(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    ch: list[dict[str, np.ndarray]],
    pair: tuple[int, int],
    after: tuple[bool, ...],
) -> np.ndarray:
    """A merged step's peak above the moment before it, for every split: as
    capture_megatron.forecast.overlap.merged_peak (forward chunk, backward chunk = `pair`)."""
    cf, cb = pair
    kinds = tuple(chunk_kind(plan, pp_rank, v) for v in range(plan.vpp))
    m = overlap.merged(layers, shape, plan, kinds)
    f, b = ch[cf], ch[cb]
    f_kept = f["retained"] if after[cf] and cf != cb else 0.0
    head = b["backward"] + m.hidden
    some = (f["layers"] + b["layers"] + m.nodes(kinds[cf], kinds[cb])) > 0
    steps = np.where(some, m.hidden - m.head(kinds[cb]) + m.layer_step, 0.0)
    tail = m.hidden + f["forward"] - b["inflight"] - f_kept
    return np.maximum(np.maximum(head, steps), tail)


def _kept(ch: list[dict[str, np.ndarray]], zero: np.ndarray) -> list[np.ndarray]:
    """Per chunk, what fine-grained offloading keeps of one of its micro-batches where it is the
    last chunk with groups (offload.Kept; rank_kept), else 0."""
    out = []
    for v, c in enumerate(ch):
        later = sum((w["offload_kept"] > 0 for w in ch[v + 1 :]), zero) > 0
        out.append(np.where(later, 0.0, c["offload_kept"] + zero))
    return out


def peak_table(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    limit: int,
    cache: dict | None = None,
) -> np.ndarray:
    """table[k0, k1, ...] = rank_memory(layers, shape, plan, pp_rank, (k0, k1, ...)).peak for every
    chunk count 0..limit (plan.vpp dimensions; layers of one variant, not mixed)."""
    vpp = plan.vpp
    ch = [_chunk_arrays(layers, shape, plan, pp_rank, v, limit, cache) for v in range(vpp)]
    zero = np.zeros([1] * vpp)
    params = sum((c["params"] for c in ch), zero)
    grads = sum((c["grads"] for c in ch), zero)
    opt = sum((c["optimizer"] for c in ch), zero)
    other, step = ch[0]["buffers"], ch[0]["step"]
    for c in ch[1:]:
        other, step = np.maximum(other, c["buffers"]), np.maximum(step, c["step"])
    routing = sum((c["routing_state"] for c in ch), zero)
    pair, gathers = deferral(shape, plan, pp_rank)
    step = step + sum((c["step_copies"] for c in ch), zero)
    alone = ch[0]["step_alone"]
    for c in ch[1:]:
        alone = np.maximum(alone, c["step_alone"])
    step = np.maximum(step, alone)
    graphs = graph_buffer_table(shape, plan, pp_rank, limit)  # CUDA graphs' static inputs
    static = params + grads + opt + (other + layers.workspace_bytes + routing + gathers + graphs)
    kept = sum((c["retained"] for c in ch), zero)
    best = np.broadcast_to(static + kept + step, (limit + 1,) * vpp).copy()
    held_back = _kept(ch, zero)
    # moments with the same (kind, chunk, held, retaining) add the same transient; rounding is
    # monotone, so the largest of their activations gives the largest total
    groups: dict[tuple, list[tuple[int, ...]]] = {}
    for kind, chunk, live, held, after, done in plan_states(plan, pp_rank, pair > 0):
        groups.setdefault((kind, chunk, held, after, done), []).append(live)
    limit = plan.ddp.deferred(plan.num_microbatches)
    for (kind, chunk, held, after, done), lives in groups.items():
        counts = np.asarray(lives, dtype=np.float64)
        acts = zero
        for v in range(vpp):
            alive = counts[:, v].reshape((-1,) + (1,) * vpp)
            acts = acts + alive * ch[v]["inflight"]
            acts = acts + (held_back[v] * (alive > 0) if kind == "F" else 0.0)
        pair_of = (chunk % vpp, chunk // vpp) if kind == "M" else None
        chunk = pair_of[1] if pair_of else chunk
        others = sum((ch[v]["retained"] for v in range(vpp) if after[v] and v != chunk), zero)
        transient = {"F": ch[chunk]["forward"], "B": ch[chunk]["backward"]}.get(kind, zero)
        if pair_of:
            transient = _merged(layers, shape, plan, pp_rank, ch, pair_of, after)
        if held >= 0 and kind != "D":
            h = ch[held]
            counted = (after[held] and held != chunk) or (held == chunk and kind == "F")
            grad = np.minimum(h["retained_grad"], h["input_bytes"]) if counted else 0.0
            transient = transient + (h["input_bytes"] - grad)
        deferred = min(done, limit) * pair
        np.maximum(best, static + (acts + others + deferred).max(axis=0) + transient, out=best)
    return best
