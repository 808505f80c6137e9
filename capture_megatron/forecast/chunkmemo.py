"""The chunk-cost memo: a rank's chunk costs (forecast.chunks.chunk_cost) computed once per kind,
layers and recomputed layers for a plan, and shared by the plans of one search whose chunks cost
the same (pure Python)."""

from __future__ import annotations

from dataclasses import fields
from functools import lru_cache

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.forecast.chunks import ChunkCost, chunk_cost, kind_of
from capture_megatron.forecast.layers import Layers

ChunkMemos = dict[tuple, tuple[object, object, dict]]
"""Chunk costs (cached_chunk's memo) shared by the plans of one search whose
chunks cost the same, by chunk_memo's key: (the fitted models keyed by identity, kept alive
here, the memo)."""

_SIGNED = tuple(
    f.name for f in fields(ParallelPlan) if f.name not in ("vpp", "layers_per_stage", "recompute")
)
"""The plan fields a chunk's cost may read besides its own layers (cached_chunk's key: its kind,
layers and recomputed layers): all but the interleaving, the split and the recompute counts."""


def chunk_memo(memos: ChunkMemos | None, layers: Layers, plan: ParallelPlan) -> dict:
    """The chunk-cost memo `plan` shares with the plans of `memos` whose chunks cost the same
    (those differing in interleaving, split or recompute counts only), a new one without memos."""
    if memos is None:
        return {}
    rc = plan.recompute
    adam = (layers.torch_adam, layers.foreach_adam, layers.full_moments)
    flags = (layers.step_measured, adam, layers.pattern)
    signed = tuple(getattr(plan, name) for name in _SIGNED)
    key = (id(layers.main), id(layers.dense), flags, signed, rc.granularity, rc.method, rc.modules)
    kept = memos.get(key)
    if kept is None or kept[0] is not layers.main or kept[1] is not layers.dense:
        kept = memos[key] = (layers.main, layers.dense, {})
    return kept[2]


def cached_chunk(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    vp: int,
    moe: tuple[bool, ...],
    cache: dict | None,
) -> ChunkCost:
    """chunk_cost, memoised in `cache` by what it depends on for a fixed plan: kind, layers,
    recomputed."""
    if cache is None:
        return chunk_cost(layers, shape, plan, pp_rank, vp, moe)
    return rank_chunks(layers, shape, plan, pp_rank, [moe], cache, vp)[0]


def rank_chunks(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    moe: list[tuple[bool, ...]],
    cache: dict,
    first: int = 0,
) -> list[ChunkCost]:
    """cached_chunk of a rank's chunks from chunk `first` on (their layers' variants `moe`)."""
    n = plan.recompute.layers_on(pp_rank) if plan.recompute.granularity == "full" else 0
    kinds = _chunk_kinds(plan.pp, plan.vpp, pp_rank)
    out = []
    for vp, layer_kinds in enumerate(moe, first):
        key = (kinds[vp], layer_kinds, min(n, len(layer_kinds)))
        cost = cache.get(key)
        if cost is None:
            cost = cache[key] = chunk_cost(layers, shape, plan, pp_rank, vp, layer_kinds)
        out.append(cost)
    return out


@lru_cache(maxsize=4096)
def _chunk_kinds(pp: int, vpp: int, pp_rank: int) -> tuple[str, ...]:
    """chunk_kind of each of a rank's chunks."""
    return tuple(kind_of(pp, vpp, pp_rank, v) for v in range(vpp))
