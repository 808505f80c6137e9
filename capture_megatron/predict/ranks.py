"""Predict every pipeline rank's peak memory for a ParallelPlan from a fitted MemoryModel.

A rank's memory is simulated over megatron-core's own schedule (capture_megatron.predict.schedule):
static bytes (parameters, DDP gradient buffers, optimizer state, Megatron's global buffers) plus,
event by event, the activations of the micro-batches in flight on each of its chunks; a forward adds
its transient peak on top, a backward likewise; the optimizer step adds its own. The peak is the
maximum over all of them (iterations after the first, when optimizer state exists). Pure Python."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, ShapeConstants, Sizes, VariantModel, shape_sizes
from capture_megatron.predict.schedule import ScheduleSpec, events
from capture_megatron.predict.static import layer_static
from capture_megatron.predict.support import experts_probe, refuse_unforecast
from capture_megatron.records import ProbeShape, Variant
from capture_megatron.serial import JsonMixin


@dataclass(frozen=True)
class ChunkCost:
    """Predicted per-micro-batch and static costs of one model chunk on one rank."""

    kind: str
    """first, middle, last or only."""
    layers: int
    """Transformer layers."""
    inflight: float
    """Bytes one micro-batch holds between its forward and backward (received input + saved)."""
    input_bytes: float
    """Bytes of the activation received per micro-batch."""
    forward: float
    """Forward peak above the live bytes before it (input already received)."""
    backward: float
    """Backward peak above the live bytes before it."""
    step: float
    """Optimizer-step peak above the live bytes before it."""
    params: int
    """Parameter bytes."""
    grads: int
    """Gradient-buffer bytes."""
    optimizer: int
    """Optimizer-state bytes (this DP rank's shard)."""
    buffers: float
    """Persistent buffers the chunk needs on its rank (Megatron's global buffers, TE's dummy
    wgrads); a rank holds the largest of its chunks'."""
    recomputed: float = 0.0
    """Of `backward`: the activations a full-recompute backward re-creates and holds at its peak
    (the recomputed layer's, or the group's with the uniform method; 0 without recompute)."""


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
    (with full recompute, the recomputed layers' activations re-created for it)."""
    transient: float
    """Temporaries of the forward/backward/step running at the peak, beyond those activations
    (e.g. logits and loss, gradients being computed, the input gradient the schedule still
    holds)."""
    other: float
    """Megatron's global buffers and, for GPU kernels, the cuBLAS / TE workspaces."""
    phase: str
    """forward, backward or step: what runs at the peak."""
    inflight: tuple[int, ...]
    """Micro-batches alive per local chunk at the peak."""


def variant_of(shape: ModelShape, plan: ParallelPlan) -> Variant:
    """The categorical settings a (shape, plan) needs from the memory model."""
    refuse_unforecast(shape, plan)
    moe = experts_probe(shape, plan)
    return Variant.of(shape, plan.recompute.granularity, plan.sequence_parallel, moe, plan.cp)


def sizes_for(shape: ModelShape, plan: ParallelPlan) -> Sizes:
    """Regression sizes of a (shape, plan): those of the model's own probe shape."""
    return shape_sizes(ProbeShape.of(shape, plan.tp, plan.micro_batch_size))


def find_variant(model: MemoryModel, variant: Variant) -> VariantModel:
    """The fitted VariantModel, or a CaptureError naming what is missing."""
    for vm in model.variants:
        if vm.variant == variant:
            return vm
    have = (
        "; ".join(
            f"{v.variant.dtype}/{v.variant.recompute}/sp={v.variant.sequence_parallel}"
            for v in model.variants
        )
        or "none"
    )
    raise CaptureError(
        f"the {model.device} memory model has no fit for {variant.dtype}, recompute "
        f"{variant.recompute}, sequence parallel {variant.sequence_parallel}, swiglu "
        f"{variant.swiglu}, {variant.normalization}, {variant.position_embedding_type}, dropout "
        f"{variant.dropout}, untied {variant.untied}, geglu {variant.geglu}, qkv bias "
        f"{variant.add_qkv_bias}, window {variant.window_size or 'none'} (fitted: {have}); "
        "profile that variant"
    )


def chunk_kind(plan: ParallelPlan, pp_rank: int, vp: int) -> str:
    """Which ends a chunk holds."""
    if plan.pp == 1:
        return "only"
    if pp_rank == 0 and vp == 0:
        return "first"
    if pp_rank == plan.pp - 1 and vp == plan.vpp - 1:
        return "last"
    return "middle"


def _activations(
    sc: ShapeConstants, kind: str, k: int, n: int
) -> tuple[float, float, float, float, float]:
    """(input, saved, forward peak, backward peak, recomputed) of a chunk with k layers, n
    recomputed; `recomputed`: the activations the backward re-creates at its peak."""
    c = sc.chunk(kind)
    inp = c.input_bytes
    if k == 0:
        if kind == "middle":  # an empty stage passes its input on; the schedule keeps the input
            return inp, 0.0, 0.0, inp, 0.0
        return inp, c.need("saved0"), c.need("fwd0"), c.need("bwd0"), 0.0
    s, r = sc.layer_saved, (sc.layer_saved_rc or 0.0)
    r2 = r if sc.layer_saved_rc_next is None else sc.layer_saved_rc_next
    kept = r + (n - 1) * r2 if n else 0.0  # the first recomputed layer, then each further one
    saved = c.saved1 + (k - 1 - n) * s + kept
    # after recomputed layers the first kept layer's input is a fresh tensor (r2), not the chunk's
    # input
    fwd = (
        c.fwd1 + kept + (k - n - 1) * s + (r2 - r if n else 0.0)
        if n < k
        else c.need("fwdrc") + (k - 1) * r2
    )
    # a recomputed layer's backward re-creates what the layer saves, less its kept input
    again = max(s - r2, 0.0)
    if n == 0:
        bwd, redone = c.bwd1, 0.0
    elif n < k:
        mixed = c.need("bwdmix") - (k - n - 1) * s
        bwd, redone = max(c.bwd1, mixed), (again if mixed >= c.bwd1 else 0.0)
    else:
        bwd, redone = c.need("bwdrc"), again
    return inp, saved, fwd, bwd, min(redone, max(bwd, 0.0))


def _uniform(
    sc: ShapeConstants, kind: str, k: int, n: int
) -> tuple[float, float, float, float, float]:
    """(input, saved, forward peak, backward peak, recomputed) of a chunk with k layers all
    recomputed n at a time (--recompute-method uniform: megatron checkpoints groups of n
    consecutive layers, the last group holding the rest). Each group keeps only its input, as one
    recomputed layer does (r for the first, r2 for the others); the backward of a group of m
    recomputes m layers at once, so it holds m - 1 layers' activations more than a recomputed
    layer's backward; the groups after it are freed by then."""
    c = sc.chunk(kind)
    s, r = sc.layer_saved, (sc.layer_saved_rc or 0.0)
    r2 = r if sc.layer_saved_rc_next is None else sc.layer_saved_rc_next
    groups = -(-k // n)
    last = k - (groups - 1) * n
    saved = c.saved1 - s + r + (groups - 1) * r2
    fwd = c.need("fwdrc") + (groups - 1) * r2
    bwd, group = c.need("bwdrc") + (last - 1) * s, last
    if groups > 1 and c.need("bwdrc") + (n - 1) * s - r2 > bwd:
        bwd, group = c.need("bwdrc") + (n - 1) * s - r2, n
    redone = max(group * s - r2, 0.0)
    return c.input_bytes, saved, fwd, bwd, min(redone, max(bwd, 0.0))


def chunk_cost(
    vm: VariantModel,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    vp: int,
    layers: int | None = None,
) -> ChunkCost:
    """Predicted costs of one chunk (holding `layers` layers, by default the plan's)."""
    sc = vm.constants(sizes_for(shape, plan))
    kind = chunk_kind(plan, pp_rank, vp)
    k = plan.chunks_of(pp_rank)[vp] if layers is None else layers
    n = min(plan.recompute.layers_on(pp_rank), k) if plan.recompute.granularity == "full" else 0
    if n and plan.recompute.method == "uniform":
        inp, saved, fwd, bwd, redone = _uniform(sc, kind, k, n)
    else:
        inp, saved, fwd, bwd, redone = _activations(sc, kind, k, n)
    c = sc.chunk(kind)
    step = c.need("step0") if k == 0 and kind != "middle" else c.step1
    pre, post = _ends(sc, kind)
    shared = _shared_end(kind, shape, plan, len(pre) + k * len(sc.layer_numels) + len(post))
    dp = (plan.dp * plan.cp, plan.expert_dp)
    st = layer_static(
        pre, sc.layer_numels, sc.layer_expert, k, post, shape.dtype, dp,
        plan.distributed_optimizer, shared,
    )  # fmt: skip
    buffers = c.buffers1 if k else (c.need("buffers0") if kind != "middle" else 0.0)
    return ChunkCost(
        kind,
        k,
        inp + saved,
        inp,
        fwd,
        bwd,
        step,
        st.params,
        st.grads,
        st.optimizer,
        buffers,
        redone,
    )


def _cached_chunk(
    vm: VariantModel,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    vp: int,
    k: int,
    cache: dict | None,
) -> ChunkCost:
    """chunk_cost, memoised in `cache` by what it depends on for a fixed plan: kind, layers,
    recomputed."""
    if cache is None:
        return chunk_cost(vm, shape, plan, pp_rank, vp, k)
    n = plan.recompute.layers_on(pp_rank) if plan.recompute.granularity == "full" else 0
    key = (chunk_kind(plan, pp_rank, vp), k, min(n, k))
    if key not in cache:
        cache[key] = chunk_cost(vm, shape, plan, pp_rank, vp, k)
    return cache[key]


def _ends(sc: ShapeConstants, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Parameter element counts before and after the layers, in module order: the embedding's
    tensors first; the final norm and the output layer last."""
    ends = tuple(sc.chunk(kind).end_numels)
    if kind == "first":
        return ends, ()
    if kind == "last":
        return (), ends
    if kind == "only":
        head = len(sc.chunk("first").end_numels)
        return ends[:head], ends[head:]
    return (), ()


def _shared_end(kind: str, shape: ModelShape, plan: ParallelPlan, count: int) -> str | None:
    """Which end holds the tied embedding that DDP gives its own bucket (tied weights with PP >
    1)."""
    if shape.untie_embeddings_and_output_weights or plan.pp == 1 or count == 0:
        return None
    return {"first": "pre", "last": "post"}.get(kind)


Moment = tuple[str, int, tuple[int, ...], int]
"""(kind, chunk, live micro-batches per chunk before the event, chunk whose input gradient the
schedule still holds or -1)."""


@functools.lru_cache(maxsize=4096)
def schedule_states(
    pp: int, num_microbatches: int, vpp: int, pp_rank: int, group: int = 0
) -> tuple[Moment, ...]:
    """The distinct Moments of a rank's schedule that can be its peak, in first-seen order."""
    live, held = [0] * vpp, -1
    seen: dict[Moment, None] = {}
    spec = ScheduleSpec(
        pp=pp, num_microbatches=num_microbatches, vpp=vpp, microbatch_group_size=group
    )
    for ev in events(spec, pp_rank):
        seen.setdefault((ev.kind, ev.chunk, tuple(live), held), None)
        live[ev.chunk] += 1 if ev.kind == "F" else -1
        if ev.kind == "B":
            held = ev.chunk
    # a moment is dropped when the same (kind, chunk, held) moment has at least as many
    # micro-batches alive in every chunk: its memory is never higher, so it cannot be the rank's
    # peak
    groups: dict[tuple[str, int, int], list[tuple[int, ...]]] = {}
    for state in seen:
        groups.setdefault((state[0], state[1], state[3]), []).append(state[2])
    keep: set[tuple[tuple[str, int, int], tuple[int, ...]]] = set()
    for key, lives in groups.items():
        front = [
            alive
            for alive in lives
            if not any(o != alive and all(a >= b for a, b in zip(o, alive)) for o in lives)
        ]
        keep.update((key, alive) for alive in (_upper_hull(front) if vpp == 2 else front))
    return tuple(s for s in seen if ((s[0], s[1], s[3]), s[2]) in keep)


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


def _running(c: ChunkCost, kind: str) -> float:
    """Of the peak of the forward ("F") or backward ("B") running on chunk `c`: the activations
    it holds beyond the micro-batches alive before it. A forward holds its received input and
    what it has saved by its peak (at most its saved bytes; the rest of its peak is temporaries);
    a backward's micro-batch is already counted alive, and with full recompute its peak holds the
    recomputed layers' activations again."""
    if kind == "F":
        return c.input_bytes + max(min(c.inflight - c.input_bytes, c.forward), 0.0)
    return c.recomputed


def rank_memory(
    vm: VariantModel,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    counts: tuple[int, ...] | None = None,
    cache: dict | None = None,
) -> StageMemory:
    """One pipeline rank's peak over megatron's schedule (its chunks holding `counts` layers).

    `cache` (a dict the caller keeps for one plan) memoises chunk costs across calls."""
    counts = plan.chunks_of(pp_rank) if counts is None else counts
    chunks = [_cached_chunk(vm, shape, plan, pp_rank, v, counts[v], cache) for v in range(plan.vpp)]
    params = sum(c.params for c in chunks)
    grads = sum(c.grads for c in chunks)
    opt = sum(c.optimizer for c in chunks)
    other = max(c.buffers for c in chunks) + vm.workspace_bytes
    static = params + grads + opt + other
    step = max(c.step for c in chunks)
    best = (static + step, 0.0, step, "step", (0,) * plan.vpp)
    moments = schedule_states(
        plan.pp, plan.num_microbatches, plan.vpp, pp_rank, plan.microbatch_group_size
    )
    for kind, chunk, live, held in moments:
        c = chunks[chunk]
        transient = (chunks[held].input_bytes if held >= 0 else 0.0) + (
            c.input_bytes + c.forward if kind == "F" else c.backward
        )
        acts = sum(n * ch.inflight for n, ch in zip(live, chunks))
        if static + acts + transient > best[0]:
            running = _running(c, kind)  # moved from transient to activations: same total
            best = (
                static + acts + transient,
                acts + running,
                transient - running,
                "forward" if kind == "F" else "backward",
                live,
            )
    peak, activations, transient, phase, inflight = best
    return StageMemory(
        pp_rank=pp_rank,
        peak=peak,
        params=params,
        grads=grads,
        optimizer=opt,
        activations=activations,
        transient=transient,
        other=other,
        phase=phase,
        inflight=inflight,
    )


def predict(model: MemoryModel, shape: ModelShape, plan: ParallelPlan) -> tuple[StageMemory, ...]:
    """Every pipeline rank's predicted peak (the maximum over its TP/DP peers, which are alike)."""
    vm = find_variant(model, variant_of(shape, plan))
    return tuple(rank_memory(vm, shape, plan, r) for r in range(plan.pp))
