"""A rank's schedule moments: the distinct ones that can be its peak (schedule_states), and as
arrays, so that its peak over them is a few vector operations.

The planner asks for tens of thousands of rank peaks per search (every layer count, chunk split and
recompute count of every candidate's ranks), each a maximum over the same schedule's moments
(schedule_states) with other chunk costs. Per schedule, the moments
are turned once into a matrix of micro-batches alive per chunk, a mask of the other chunks that
retain what their last backward left, and the indices of the running and held chunks; the memory
at every moment is then two matrix-vector products and a few gathers (ranks._moment gives the same
sums one moment at a time, and the breakdown of the peak moment). Pure Python with numpy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from capture_megatron.forecast.chunks import ChunkCost
from capture_megatron.forecast.schedule import ScheduleSpec, events
from capture_megatron.serial import ByIdentity


class Moment(NamedTuple):
    """One point of a rank's schedule that can be its peak: an event about to run and what the
    schedule holds then. Kind "D" is the drain of a deferred embedding weight gradient, after the
    schedule's last backward."""

    kind: str
    """F (forward), B (backward), M (a merged forward + backward step) or D (the drain)."""
    chunk: int
    """The local chunk the event runs on (M: the forward's + vpp x the backward's)."""
    live: tuple[int, ...]
    """Micro-batches alive per local chunk before the event."""
    held: int
    """The chunk whose input gradient the schedule still holds, or -1."""
    after: tuple[bool, ...]
    """Per chunk, whether its last pass was a backward: it retains what that left
    (capture_megatron.forecast.retained); every chunk does at an iteration's start."""
    done: int
    """Backward passes the output layer's chunk has completed when the last stage defers its
    weight gradient, else 0."""


@dataclass(frozen=True, eq=False)
class MomentArrays:
    """A rank's schedule moments (Moment) as arrays, one row per moment."""

    kind: np.ndarray
    """0: forward, 1: backward, 2: the deferred weight gradients' drain."""
    chunk: np.ndarray
    """The running pass's chunk."""
    live: np.ndarray
    """Micro-batches alive per chunk before the event (moments x chunks, float)."""
    others_retaining: np.ndarray
    """1 where a chunk other than the running one retains what its last backward left."""
    held: np.ndarray
    """The chunk whose input gradient the schedule holds (0 where none: see `holding`)."""
    holding: np.ndarray
    """Whether an input gradient is held and counted in the transient (not at a drain)."""
    counted: np.ndarray
    """Whether that gradient is already counted as retained (then only the rest is added)."""
    done: np.ndarray
    """Backward passes of the output layer's chunk completed (deferred weight gradients)."""
    weights: np.ndarray
    """moments x (chunks x 6): what each chunk's ChunkCost.moment_terms add to a moment's bytes
    above the static ones (micro-batches alive x inflight, retaining x retained, the running
    forward's or backward's peak, the held input gradient less what is counted as retained)."""


KINDS = {"F": 0, "B": 1, "D": 2}
"""MomentArrays.kind of each kind of moment."""


_BY_IDENTITY: ByIdentity[MomentArrays] = ByIdentity()
"""moment_arrays by the moments tuple's identity (hashing a long tuple on every call is what a
value-keyed cache costs)."""


def moment_arrays(moments: tuple[Moment, ...], vpp: int) -> MomentArrays:
    """The arrays of a schedule's moments (schedule_states' tuple, which is cached too, so
    the same schedule is the same object)."""
    return _BY_IDENTITY.get(moments, vpp, lambda: _moment_arrays(moments, vpp))


@functools.lru_cache(maxsize=4096)
def _moment_arrays(moments: tuple[Moment, ...], vpp: int) -> MomentArrays:
    """moment_arrays by value."""
    n = len(moments)
    kind = np.array([KINDS[m.kind] for m in moments], dtype=np.int64).reshape(n)
    chunk = np.array([m.chunk for m in moments], dtype=np.int64).reshape(n)
    live = np.array([m.live for m in moments], dtype=np.float64).reshape(n, vpp)
    after = np.array([m.after for m in moments], dtype=bool).reshape(n, vpp)
    held = np.array([m.held for m in moments], dtype=np.int64).reshape(n)
    rows = np.arange(n)
    others = after.copy()
    others[rows, chunk] = False
    holding = (held >= 0) & (kind != KINDS["D"])
    at = np.where(held >= 0, held, 0)
    counted = (after[rows, at] & (at != chunk)) | ((at == chunk) & (kind == KINDS["F"]))
    done = np.array([m.done for m in moments], dtype=np.float64).reshape(n)
    weights = np.zeros((n, vpp, 6))  # by ChunkCost.moment_terms
    weights[:, :, 0], weights[:, :, 1] = live, others
    weights[rows, chunk, 2] = kind == KINDS["F"]
    weights[rows, chunk, 3] = kind == KINDS["B"]
    weights[rows, at, 4] += holding
    weights[rows, at, 5] -= holding & counted
    flat = weights.reshape(n, -1)
    return MomentArrays(kind, chunk, live, others.astype(float), at, holding, counted, done, flat)


def moment_totals(
    arrays: MomentArrays, chunks: Sequence[ChunkCost], pair: float, limit: int
) -> np.ndarray:
    """The bytes held at every moment above the static ones: activations and the running pass's
    transient (ranks._moment), and the deferred weight gradients' pairs (`pair` bytes for each of
    at most `limit` completed backward passes)."""
    totals = arrays.weights @ np.array([c.moment_terms for c in chunks]).ravel()
    return totals + np.minimum(arrays.done, limit) * pair if pair else totals


@functools.lru_cache(maxsize=4096)
def schedule_states(
    pp: int,
    num_microbatches: int,
    vpp: int,
    pp_rank: int,
    group: int = 0,
    defer: bool = False,
    overlap: bool = False,
) -> tuple[Moment, ...]:
    """The distinct Moments of a rank's schedule that can be its peak, in first-seen order
    (`defer`: --defer-embedding-wgrad-compute, whose buffers grow with the last stage's backward
    passes; `overlap`: --overlap-moe-expert-parallel-comm, whose merged (forward, backward) steps
    are one Moment of kind "M" before both, its chunk the forward's + vpp x the backward's)."""
    live, held, after, done = [0] * vpp, -1, [True] * vpp, 0
    counting = defer and pp_rank == pp - 1
    seen: dict[Moment, None] = {}
    spec = ScheduleSpec(
        pp=pp,
        num_microbatches=num_microbatches,
        vpp=vpp,
        microbatch_group_size=group,
        overlap=overlap,
    )
    order = events(spec, pp_rank)
    for i, ev in enumerate(order):
        if i and order[i - 1].merged:  # the backward of a merged step: recorded with its forward
            pass
        elif ev.merged:
            pair = ev.chunk + vpp * order[i + 1].chunk
            seen.setdefault(Moment("M", pair, tuple(live), held, tuple(after), done), None)
        else:
            seen.setdefault(Moment(ev.kind, ev.chunk, tuple(live), held, tuple(after), done), None)
        live[ev.chunk] += 1 if ev.kind == "F" else -1
        after[ev.chunk] = ev.kind == "B"
        if ev.kind == "B":
            held = ev.chunk
            done += int(counting and ev.chunk == vpp - 1)
    if counting:
        seen.setdefault(Moment("D", vpp - 1, tuple(live), held, tuple(after), done), None)
    # a moment is dropped when the same (kind, chunk, held, retaining) moment has at least as
    # many micro-batches alive in every chunk: its memory is never higher, so it cannot be the
    # rank's peak
    groups: dict[tuple, list[tuple[int, ...]]] = {}
    for state in seen:
        groups.setdefault(_key(state), []).append(state.live)
    keep: set[tuple[tuple, tuple[int, ...]]] = set()
    for key, lives in groups.items():
        front = [
            alive
            for alive in lives
            if not any(o != alive and all(a >= b for a, b in zip(o, alive)) for o in lives)
        ]
        keep.update((key, alive) for alive in (_upper_hull(front) if vpp == 2 else front))
    return tuple(s for s in seen if (_key(s), s.live) in keep)


def _key(state: Moment) -> tuple:
    """What two moments must share for one to dominate the other by micro-batches alive."""
    return state.kind, state.chunk, state.held, state.after, state.done


def _upper_hull(front: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Vertices of the upper hull of a 2-chunk Pareto front: the only points where a sum
    w0 * live0 + w1 * live1 with weights >= 0 (the activations held) can be largest."""
    hull: list[tuple[int, ...]] = []
    for p in sorted(set(front)):
        while (
            len(hull) >= 2
            and (hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
            - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
            >= 0
        ):
            hull.pop()
        hull.append(p)
    return hull
