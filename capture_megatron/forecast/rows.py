"""Rank peaks in rows: one pipeline rank's predicted peak for each of many splits of its layers over
its chunks at once (ranks.rank_peak's arithmetic over arrays, one row per split).

A rank of many chunks has too many combinations of chunk counts for a table
(capture_megatron.forecast.table), but the min-max memory split weighs only a few splits of each
total (the near-even ones): their peaks are one matrix product with the schedule's moments
(forecast.moments.MomentArrays.weights) and a few vector sums. The static bytes add in rank_peak's
order, bit for bit; the moments' sums come from a matrix product instead of one matrix-vector
product per split, so a row may differ from rank_peak by a few units of rounding (the partitioner
asks rank_peak itself where that could tip a comparison: planner.partition.NEAR). Pure Python and
numpy."""

from __future__ import annotations

import numpy as np

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.forecast.chunkmemo import cached_chunk
from capture_megatron.forecast.cuda_graphs import graph_buffer_rows
from capture_megatron.forecast.layers import Layers
from capture_megatron.forecast.moments import MomentArrays, moment_arrays
from capture_megatron.forecast.ranks import deferral, plan_states


def rows_apply(plan: ParallelPlan, shape: ModelShape, pp_rank: int) -> bool:
    """Whether peak_rows covers the plan's rank: not the EP overlap's merged steps, nor the
    deferred embedding weight gradients' pairs (rank_peak's other paths)."""
    return not plan.ddp.overlap_moe_expert_parallel_comm and not deferral(shape, plan, pp_rank)[0]


def peak_rows(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    splits: np.ndarray,
    cache: dict | None = None,
) -> np.ndarray | None:
    """rows[i] = rank_peak(layers, shape, plan, pp_rank, splits[i]) to within rounding (`splits`:
    one row of chunk counts per split; layers of one variant, not mixed; `cache`: the chunk-cost
    memo); None where the rows do not cover the rank (rows_apply)."""
    if not rows_apply(plan, shape, pp_rank):
        return None
    vpp, top = plan.vpp, int(splits.max(initial=0))
    costs = [
        [cached_chunk(layers, shape, plan, pp_rank, v, layers.chunk(None, k), cache)
         for k in range(top + 1)]
        for v in range(vpp)
    ]  # fmt: skip
    terms = [np.array([c.rank_terms for c in costs[v]])[splits[:, v]] for v in range(vpp)]
    moving = [np.array([c.moment_terms for c in costs[v]])[splits[:, v]] for v in range(vpp)]
    arrays = moment_arrays(plan_states(plan, pp_rank, False), vpp)
    moments = arrays.weights @ np.concatenate(moving, axis=1).T  # moments x rows

    def summed(i: int) -> np.ndarray:
        out = np.zeros(len(splits))
        for t in terms:
            out = out + t[:, i]
        return out

    def largest(i: int) -> np.ndarray:
        out = terms[0][:, i]
        for t in terms[1:]:
            out = np.maximum(out, t[:, i])
        return out

    # ranks._sums: params, grads, optimizer, routing, buffers, gathered dense / expert, step,
    # step copies, step alone, retained
    graphs = graph_buffer_rows(shape, plan, pp_rank, splits)
    other = largest(4) + layers.workspace_bytes + summed(3) + deferral(shape, plan, pp_rank)[1]
    other = other + graphs
    step = np.maximum(largest(7), np.maximum(summed(5), summed(6))) + summed(8)
    step = np.maximum(step, largest(9))
    static = summed(0) + summed(1) + summed(2) + other
    at_step = static + summed(10) + step
    total = (static + moments + _kept(arrays, terms)).max(axis=0)
    return np.where(total > at_step, total, at_step)


def _kept(arrays: MomentArrays, terms: list[np.ndarray]) -> np.ndarray | float:
    """What fine-grained activation offloading keeps on the device at each moment of each row
    (moments x rows; offload.Kept.at: at a forward while the last chunk with groups has a
    micro-batch alive), 0 without it."""
    kept = np.stack([t[:, 11] for t in terms], axis=1)  # rows x chunks: ChunkCost.offload_kept
    if not kept.any():
        return 0.0
    has = kept > 0
    last = kept.shape[1] - 1 - np.argmax(has[:, ::-1], axis=1)  # offload.rank_kept's chunk
    nbytes = np.where(has.any(axis=1), kept[np.arange(len(kept)), last], 0.0)
    keeping = (arrays.kind == 0)[:, None] & (arrays.live[:, last] > 0)
    return np.where(keeping & (nbytes > 0), nbytes, 0.0)
