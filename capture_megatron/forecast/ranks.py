"""Predict every pipeline rank's peak memory for a ParallelPlan from a fitted MemoryModel.

A rank's memory is simulated over megatron-core's own schedule (capture_megatron.forecast.schedule):
static bytes (parameters, DDP gradient buffers, optimizer state, Megatron's global buffers, MoE
routing state) plus,
event by event, the activations of the micro-batches in flight on each of its chunks; a forward adds
its transient peak on top, a backward likewise; the optimizer step adds its own. The peak is the
maximum over all of them (iterations after the first, when optimizer state exists). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.fit import MemoryModel
from capture_megatron.forecast import offload, overlap
from capture_megatron.forecast.chunkmemo import cached_chunk, rank_chunks
from capture_megatron.forecast.chunks import ChunkCost
from capture_megatron.forecast.cuda_graphs import graph_buffers
from capture_megatron.forecast.layers import Layers, layers_for
from capture_megatron.forecast.moments import (
    KINDS,
    Moment,
    moment_arrays,
    moment_totals,
    schedule_states,
)
from capture_megatron.serial import OMIT_DEFAULT, JsonMixin


@dataclass(frozen=True)
class StageMemory(JsonMixin):
    """Predicted peak of one pipeline rank, broken down at the moment of the peak."""

    pp_rank: int
    """Pipeline rank."""
    peak: float
    """Predicted peak allocated bytes."""
    params: float
    """Parameters."""
    grads: float
    """Gradient buffers."""
    optimizer: float
    """Optimizer state."""
    activations: float
    """Activations held at the peak: those of the micro-batches in flight, including the one whose
    forward runs (what it has saved so far, its received input included) or whose backward runs
    (with full recompute, the recomputed layers' activations re-created for it), and what MoE
    layers retain from their chunk's last backward."""
    transient: float
    """Temporaries of the forward/backward/step running at the peak, beyond those activations
    (e.g. logits and loss, gradients being computed, the input gradient the schedule still
    holds)."""
    other: float
    """Megatron's global buffers, for GPU kernels the cuBLAS / TE workspaces, and what the MoE
    token dispatchers keep from their last forward (ChunkCost.routing_state)."""
    phase: str
    """forward, backward or step: what runs at the peak (drain: the deferred output-layer weight
    gradients after the last backward)."""
    inflight: tuple[int, ...]
    """Micro-batches alive per local chunk at the peak."""
    host: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    """Host bytes the rank keeps besides for --optimizer-cpu-offload (HybridDeviceOptimizer's host
    copies, moments and gradients; 0 without offload)."""
    activation_host: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    """Host bytes fine-grained activation offloading holds for the rank at most: the offloaded
    groups of the micro-batches in flight at the schedule's fullest moment, in megatron-core's
    pinned pool (offloaded_host; 0 without it)."""

    @property
    def host_total(self) -> float:
        """Every host byte the rank keeps (optimizer and activation offloading)."""
        return self.host + self.activation_host


PHASES = {"F": "forward", "B": "backward", "D": "drain", "M": "forward+backward"}
"""StageMemory.phase of each kind of schedule moment."""


def _running(c: ChunkCost, kind: str) -> float:
    """Of the peak of the forward ("F") or backward ("B") running on chunk `c`: the activations
    it holds beyond the micro-batches alive before it. A forward holds its received input and
    what it has saved by its peak (at most its saved bytes; the rest of its peak is temporaries);
    a backward's micro-batch is already counted alive, and with full recompute its peak holds the
    recomputed layers' activations again."""
    if kind == "F":
        return c.input_bytes + max(min(c.inflight - c.input_bytes, c.forward), 0.0)
    return c.recomputed if kind == "B" else 0.0


def _moment(
    chunks: list[ChunkCost],
    kind: str,
    chunk: int,
    live: tuple[int, ...],
    held: int,
    after: tuple[bool, ...],
) -> tuple[float, float]:
    """(activations held, transient of the running pass) at one Moment, above the static bytes.

    The activations: the micro-batches alive, and what the other chunks retain from a backward
    (the running forward's own chunk's retention is in its forward peak; a backward that follows a
    backward replaces its chunk's retention layer by layer, so it is not counted again). The
    transient: the running pass's peak and the input gradient the schedule holds, unless that
    gradient is already counted as retained."""
    c = chunks[chunk]
    transient = {"F": c.input_bytes + c.forward, "B": c.backward}.get(kind, 0.0)
    transient += _held(chunks, kind, chunk, held, after)
    kept = sum(ch.retained for i, ch in enumerate(chunks) if after[i] and i != chunk)
    return sum(n * ch.inflight for n, ch in zip(live, chunks)) + kept, transient


def _held(
    chunks: list[ChunkCost], kind: str, chunk: int, held: int, after: tuple[bool, ...]
) -> float:
    """The input gradient the schedule still holds at a Moment, unless already counted as
    retained (0 at a drain or when none is held)."""
    if held < 0 or kind == "D":
        return 0.0
    h = chunks[held]
    counted = (after[held] and held != chunk) or (held == chunk and kind == "F")
    return h.input_bytes - (min(h.retained_grad, h.input_bytes) if counted else 0.0)


def _merged_moment(
    chunks: list[ChunkCost],
    terms: overlap.Merged,
    pair: int,
    live: tuple[int, ...],
    held: int,
    after: tuple[bool, ...],
) -> tuple[float, float, int]:
    """(activations held, transient, backward chunk) at a merged step's Moment (`pair`: the
    forward's chunk + vpp x the backward's): the moment before it, as before the backward, and
    the step's peak above it (capture_megatron.forecast.overlap.merged_peak)."""
    cf, cb = pair % len(chunks), pair // len(chunks)
    acts = _moment(chunks, "B", cb, live, held, after)[0]
    f_kept = chunks[cf].retained if after[cf] and cf != cb else 0.0
    transient = overlap.merged_peak(terms, chunks[cf], chunks[cb], f_kept)
    return acts, transient + _held(chunks, "B", cb, held, after), cb


Peak = tuple[float, float, float, str, tuple[int, ...]]
"""(total, activations, transient, phase, micro-batches alive per chunk) of a rank's peak moment."""


def _all_at_once(
    chunks: list[ChunkCost],
    moments: tuple[Moment, ...],
    static: float,
    pair: float,
    limit: int,
    best: Peak,
    kept: offload.Kept,
) -> Peak:
    """The peak over `moments` (of kinds F, B and D) if above `best` (predict.moments' arrays;
    its breakdown from the peak moment's own sums); `kept`: offloading's kept groups."""
    total, top = _highest(chunks, moments, static, pair, limit, kept)
    if total <= best[0]:
        return best
    kind, chunk, live, held, after, done = moments[top]
    acts_at, transient_at = _moment(chunks, kind, chunk, live, held, after)
    acts_at += min(done, limit) * pair + kept.at(kind, live)
    running = _running(chunks[chunk], kind)  # moved from transient to activations
    return total, acts_at + running, transient_at - running, PHASES[kind], live


def _highest(
    chunks: list[ChunkCost],
    moments: tuple[Moment, ...],
    static: float,
    pair: float,
    limit: int,
    kept: offload.Kept,
) -> tuple[float, int]:
    """(the highest total over `moments` of kinds F, B and D, the first moment at it, as one
    moment at a time would find it): _all_at_once's peak without its breakdown."""
    arrays = moment_arrays(moments, len(chunks))
    totals = static + moment_totals(arrays, chunks, pair, limit)
    if kept.nbytes:
        keeping = (arrays.kind == 0) & (arrays.live[:, kept.chunk] > 0)  # as offload.Kept.at
        totals = totals + np.where(keeping, kept.nbytes, 0.0)
    top = int(totals.argmax())
    return float(totals[top]), top


def _one_by_one(
    chunks: list[ChunkCost],
    terms: overlap.Merged,
    moments: tuple[Moment, ...],
    static: float,
    pair: float,
    limit: int,
    best: Peak,
    kept: offload.Kept,
) -> Peak:
    """The peak over `moments` with merged (forward, backward) steps (kind M, under
    --overlap-moe-expert-parallel-comm), one moment at a time, if above `best` (`kept`: as for
    _all_at_once; a merged step runs a backward)."""
    for kind, chunk, live, held, after, done in moments:
        if kind == "M":
            acts, transient, chunk = _merged_moment(chunks, terms, chunk, live, held, after)
        else:
            acts, transient = _moment(chunks, kind, chunk, live, held, after)
        acts += min(done, limit) * pair + kept.at(kind, live)
        if static + acts + transient > best[0]:
            running = _running(chunks[chunk], kind)  # moved from transient to activations
            best = (static + acts + transient, acts + running, transient - running,
                    PHASES[kind], live)  # fmt: skip
    return best


def plan_states(plan: ParallelPlan, pp_rank: int, defer: bool) -> tuple[Moment, ...]:
    """schedule_states of a plan's rank (`defer`: the last stage defers its output layer's weight
    gradient)."""
    return schedule_states(
        plan.pp,
        plan.num_microbatches,
        plan.vpp,
        pp_rank,
        plan.microbatch_group_size,
        defer,
        plan.ddp.overlap_moe_expert_parallel_comm,
    )


def deferral(shape: ModelShape, plan: ParallelPlan, pp_rank: int) -> tuple[float, float]:
    """With --defer-embedding-wgrad-compute on the last stage (0, 0 elsewhere): (bytes each
    deferred micro-batch keeps from its backward until the schedule's end -- the output layer's
    input and its output gradient, MC tensor_parallel/layers.py:1003-1009 and 509-512 --, the
    two global buffers the drain gathers sequence-parallel inputs into, MC
    utils.drain_embedding_wgrad_compute "mpu_0" / "mpu_1")."""
    if not plan.ddp.defer_embedding_wgrad_compute or pp_rank != plan.pp - 1:
        return 0.0, 0.0
    act = dtype_bytes(shape.dtype)
    tokens = shape.seq_length // plan.cp * plan.micro_batch_size
    rows = tokens // plan.tp if plan.sequence_parallel else tokens
    logits = tokens * shape.padded_vocab(plan.tp) // plan.tp
    gathers = 2.0 * tokens * shape.hidden_size * act if plan.sequence_parallel else 0.0
    return float((rows * shape.hidden_size + logits) * act), gathers


class _Sums(NamedTuple):
    """What a rank's chunks add up to besides the schedule's moments (rank_memory)."""

    params: float
    grads: float
    optimizer: float
    other: float
    """Global buffers, workspaces, routing state, deferred-wgrad gathers and CUDA graphs'."""
    step: float
    """The optimizer step's peak above the static bytes."""
    retained: float
    """What every chunk keeps from its last backward (at the step)."""
    kept: offload.Kept
    host: float


def _sums(
    layers: Layers,
    chunks: list[ChunkCost],
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    moe: list[tuple[bool, ...]],
) -> _Sums:
    """A rank's static bytes and step peak from its chunks (dist_muon's all-gathers follow every
    chunk's step; `moe`: its chunks' layers, for the CUDA graphs' static inputs)."""
    params, grads, opt, routing, buffers, dense, expert, steps, copies, alone, kept, moved, host = (
        zip(*(c.rank_terms for c in chunks))
    )
    gathers = deferral(shape, plan, pp_rank)[1]
    other = max(buffers) + layers.workspace_bytes + sum(routing) + gathers
    other += graph_buffers(shape, plan, pp_rank, moe)
    step = max(max(max(steps), max(sum(dense), sum(expert))) + sum(copies), max(alone))
    keep = offload.rank_kept(moved)  # fine-grained offloading
    return _Sums(sum(params), sum(grads), sum(opt), other, step, sum(kept), keep, sum(host))


def _rank_peak(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    counts: tuple[int, ...] | None,
    cache: dict | None,
    starts: tuple[int, ...] | None,
    breakdown: bool,
) -> tuple[Peak, _Sums, list[ChunkCost], tuple[Moment, ...]]:
    """(the rank's peak, its sums, chunks and schedule moments) for rank_memory; without
    `breakdown` the peak's total alone is right (rank_peak)."""
    if counts is None:
        counts, starts = plan.chunks_of(pp_rank), plan.chunk_starts(pp_rank)
    moe = layers.chunks(starts, counts)
    if cache is None:
        chunks = [cached_chunk(layers, shape, plan, pp_rank, v, m, None) for v, m in enumerate(moe)]
    else:
        chunks = rank_chunks(layers, shape, plan, pp_rank, moe, cache)
    sums = _sums(layers, chunks, shape, plan, pp_rank, moe)
    static = sums.params + sums.grads + sums.optimizer + sums.other
    pair = deferral(shape, plan, pp_rank)[0]
    best = (static + sums.retained + sums.step, sums.retained, sums.step, "step", (0,) * plan.vpp)
    limit = plan.ddp.deferred(plan.num_microbatches)
    moments = plan_states(plan, pp_rank, pair > 0)
    if plan.ddp.overlap_moe_expert_parallel_comm:
        terms = overlap.merged(layers, shape, plan, tuple(c.kind for c in chunks))
        best = _one_by_one(chunks, terms, moments, static, pair, limit, best, sums.kept)
    elif breakdown:
        best = _all_at_once(chunks, moments, static, pair, limit, best, sums.kept)
    else:
        total = _highest(chunks, moments, static, pair, limit, sums.kept)[0]
        best = (total, 0.0, 0.0, "", ()) if total > best[0] else best
    return best, sums, chunks, moments


def rank_memory(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    counts: tuple[int, ...] | None = None,
    cache: dict | None = None,
    starts: tuple[int, ...] | None = None,
) -> StageMemory:
    """One pipeline rank's peak over megatron's schedule (its chunks holding `counts` layers from
    layers `starts`; by default the plan's; `starts` matter only when dense and MoE layers are
    mixed).

    `cache` (a dict the caller keeps for one plan) memoises chunk costs across calls."""
    best, sums, chunks, moments = _rank_peak(
        layers, shape, plan, pp_rank, counts, cache, starts, True
    )
    peak, activations, transient, phase, inflight = best
    return StageMemory(
        pp_rank=pp_rank,
        peak=peak,
        params=sums.params,
        grads=sums.grads,
        optimizer=sums.optimizer,
        activations=activations,
        transient=transient,
        other=sums.other,
        phase=phase,
        inflight=inflight,
        host=sums.host,
        activation_host=offloaded_host(chunks, moments, plan.ddp.overlap_moe_expert_parallel_comm),
    )


def rank_peak(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    counts: tuple[int, ...] | None = None,
    cache: dict | None = None,
    starts: tuple[int, ...] | None = None,
) -> float:
    """rank_memory(...).peak without its breakdown (what a split search asks of a rank)."""
    return _rank_peak(layers, shape, plan, pp_rank, counts, cache, starts, False)[0][0]


def offloaded_host(
    chunks: list[ChunkCost], moments: tuple[Moment, ...], merged: bool = False
) -> float:
    """Host bytes fine-grained activation offloading holds on a rank at most: over the schedule's
    moments, each chunk's micro-batches in flight (a forward's own one included) times what one
    of them offloads (ChunkCost.offloaded). megatron-core's pinned pool keeps its buffers for
    reuse, so its size is the fullest moment's."""
    if not any(c.offloaded for c in chunks):
        return 0.0
    if not merged:  # the arrays (merged "M" moments: the EP overlap's schedule, one by one)
        arrays = moment_arrays(moments, len(chunks))
        off = np.array([c.offloaded for c in chunks])
        own = np.where(arrays.kind == KINDS["F"], off[arrays.chunk], 0.0)
        return float(np.max(arrays.live @ off + own))

    def held(m: Moment) -> float:
        running = m.chunk % len(chunks) if m.kind in ("F", "M") else -1  # M: its forward's chunk
        return sum(
            (n + (v == running)) * c.offloaded for v, (n, c) in enumerate(zip(m.live, chunks))
        )

    return max(held(m) for m in moments)


def predict(model: MemoryModel, shape: ModelShape, plan: ParallelPlan) -> tuple[StageMemory, ...]:
    """Every pipeline rank's predicted peak (the maximum over its TP/DP peers, which are alike)."""
    layers = layers_for(model, shape, plan)
    return tuple(rank_memory(layers, shape, plan, r) for r in range(plan.pp))
