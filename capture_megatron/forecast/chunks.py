"""Predicted costs of one model chunk on one pipeline rank: its activations per micro-batch, its
forward / backward / step peaks and its static bytes, from the fitted constants of its layers'
variants (pure Python). Formulas: docs/MEMORY_MODEL.md; a chunk whose layers mix dense and MoE
layers is composed layer by layer (capture_megatron.forecast.mixed)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from capture_megatron.config import DdpOptions, ModelShape, ParallelPlan
from capture_megatron.config.kernels import FOREACH_ADAM_BYTES
from capture_megatron.fit import KindConstants, ShapeConstants, Sizes
from capture_megatron.forecast import fsdp, mixed, offload, optimizers, retained
from capture_megatron.forecast.layers import Layers, sizes_for
from capture_megatron.forecast.static import LayerRun, layer_static, layout_of
from capture_megatron.forecast.wgrad import wgrad_hold


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
    """Parameter bytes, with what low-precision linear layers keep for their weights (quantized
    copies, or low-precision parameters' other usage, and scaling state; KindConstants.lpstate1)."""
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
    retained: float = 0.0
    """Bytes the chunk keeps from its backward until its next forward (MoE layers' routing graph;
    capture_megatron.forecast.retained); `forward` holds them (its chunk's, released as it runs)."""
    retained_grad: float = 0.0
    """Of `retained`, the chunk's input gradient (also what the schedule holds after the
    backward)."""
    routing_state: float = 0.0
    """Bytes the chunk's layers keep for good beyond parameters: the MoE token dispatchers' last
    routing (probabilities and map, permutation indices; alive from the first forward on) and
    the layers' registered module buffers (MLA's YaRN cos/sin tables), Megatron-FSDP's double
    buffers and gathered non-layer weights (FsdpChunk.buffers); counted with the rank's other
    static bytes (0 for standard dense layers)."""
    step_copies: float = 0.0
    """Of the optimizer step, what it allocates for this chunk's parameters that every chunk's
    adds to (StaticBytes.copies: fp32 copies of 16-bit gradients or of low-precision optimizer
    states); `step` is the rest, the largest of a rank's chunks counts."""
    step_alone: float = 0.0
    """A step-time peak while no copies are alive (the CPU kernel set's gradient clipping with the
    precision-aware optimizer: a scaled copy of one gradient); the rank's step is the larger of
    the largest of these and its step with the copies."""
    host: float = 0.0
    """Host bytes of the chunk's optimizer (--optimizer-cpu-offload; StaticBytes.host)."""
    offload_kept: float = 0.0
    """Fine-grained activation offloading: what megatron-core keeps on the device of one
    micro-batch of this chunk if it is its rank's first chunk in backward order with layers
    (capture_megatron.forecast.offload.kept_bytes); 0 without offloading."""
    offloaded: float = 0.0
    """Fine-grained activation offloading: the bytes one micro-batch of this chunk moves to pinned
    host memory (its layers' offloaded groups); 0 without offloading."""
    gathered: tuple[float, float] = (0.0, 0.0)
    """--optimizer dist_muon: what its all-gather after the step allocates for this chunk's
    (dense, expert) parameters; a rank's gathers add up (forecast.optimizers)."""

    @cached_property
    def moment_terms(self) -> tuple[float, ...]:
        """(inflight, retained, the forward's peak with its input, backward, input_bytes, the
        retained part of the input gradient): what a schedule moment adds of the chunk
        (forecast.moments.MomentArrays.weights), once per chunk cost."""
        inp = self.input_bytes
        return (self.inflight, self.retained, inp + self.forward, self.backward, inp,
                min(self.retained_grad, inp))  # fmt: skip

    @cached_property
    def rank_terms(self) -> tuple[float, ...]:
        """(params, grads, optimizer, routing_state, buffers, gathered dense, gathered expert,
        step, step_copies, step_alone, retained, offload_kept, host): what a rank sums or takes
        the largest of over its chunks (forecast.ranks), once per chunk cost."""
        return (self.params, self.grads, self.optimizer, self.routing_state, self.buffers,
                *self.gathered, self.step, self.step_copies, self.step_alone, self.retained,
                self.offload_kept, self.host)  # fmt: skip


def chunk_kind(plan: ParallelPlan, pp_rank: int, vp: int) -> str:
    """Which ends a chunk holds."""
    return kind_of(plan.pp, plan.vpp, pp_rank, vp)


def kind_of(pp: int, vpp: int, pp_rank: int, vp: int) -> str:
    """chunk_kind by the pipeline's sizes."""
    if pp == 1:
        return "only"
    if pp_rank == 0 and vp == 0:
        return "first"
    if pp_rank == pp - 1 and vp == vpp - 1:
        return "last"
    return "middle"


def _activations(sc: ShapeConstants, kind: str, k: int, n: int) -> mixed.Costs:
    """(input, saved, forward peak, backward peak, recomputed) of a chunk with k layers, n
    recomputed; `recomputed`: the activations the backward re-creates at its peak."""
    c = sc.chunk(kind)
    inp = c.input_bytes
    if k == 0:
        if kind == "middle":  # an empty stage passes its input on; the schedule keeps the input
            return mixed.Costs(inp, 0.0, 0.0, inp, 0.0)
        return mixed.Costs(inp, c.saved_ends, c.forward_ends, c.backward_ends, 0.0)
    s, r = sc.layer_saved, (sc.layer_saved_rc or 0.0)
    r2 = r if sc.layer_saved_rc_next is None else sc.layer_saved_rc_next
    kept = r + (n - 1) * r2 if n else 0.0  # the first recomputed layer, then each further one
    saved = c.saved1 + (k - 1 - n) * s + kept
    # after recomputed layers the first kept layer's input is a fresh tensor (r2), not the chunk's
    # input
    fwd = (
        c.fwd1 + kept + (k - n - 1) * s + (r2 - r if n else 0.0)
        if n < k
        else c.forward_recomputed + (k - 1) * r2
    )
    # a recomputed layer's backward re-creates what the layer saves, less its kept input
    again = max(s - r2, 0.0)
    if n == 0:
        bwd, redone = c.bwd1, 0.0
    elif n < k:
        first_redone = c.backward_mixed - (k - n - 1) * s
        bwd, redone = max(c.bwd1, first_redone), (again if first_redone >= c.bwd1 else 0.0)
    else:
        bwd, redone = c.backward_recomputed, again
    return mixed.Costs(inp, saved, fwd, bwd, min(redone, max(bwd, 0.0)))


def _uniform(sc: ShapeConstants, kind: str, k: int, n: int) -> mixed.Costs:
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
    fwd = c.forward_recomputed + (groups - 1) * r2
    bwd, group = c.backward_recomputed + (last - 1) * s, last
    if groups > 1 and c.backward_recomputed + (n - 1) * s - r2 > bwd:
        bwd, group = c.backward_recomputed + (n - 1) * s - r2, n
    redone = max(group * s - r2, 0.0)
    return mixed.Costs(c.input_bytes, saved, fwd, bwd, min(redone, max(bwd, 0.0)))


def _costs(
    layers: Layers, z: Sizes, kind: str, moe: tuple[bool, ...], n: int, method: str
) -> tuple[mixed.Costs, tuple[float, float]]:
    """(input, saved, forward peak, backward peak, recomputed) of a chunk whose layers are of
    variants `moe` (per layer: an MoE layer?), the first n recomputed by `method` (n: 0 for
    none), and (retained bytes, of them its input gradient)."""
    uni = bool(n) and method == "uniform"
    if len(set(moe)) <= 1:
        sc = layers.model(moe[0] if moe else True).constants(z)
        costs = _uniform(sc, kind, len(moe), n) if uni else _activations(sc, kind, len(moe), n)
        consts = {m: sc for m in (False, True)}
    else:
        consts = {m: layers.model(m).constants(z) for m in (False, True)}
        costs = (mixed.uniform if uni else mixed.block)(consts.__getitem__, kind, moe, n)
    get = consts.__getitem__
    ret, grad = retained.retention(get, kind, moe, n, uni)
    fwd_floor, bwd_floor, growth = retained.peaks(get, kind, moe, n, uni, ret)
    held = costs._replace(
        forward=max(costs.forward, fwd_floor), backward=max(costs.backward, bwd_floor) + growth
    )
    return held, (ret, grad)


def _runs(
    layers: Layers, z: Sizes, moe: tuple[bool, ...]
) -> tuple[tuple[LayerRun, ...], tuple[tuple[bool, ...], ...], float]:
    """The chunk's layers as runs of one variant: (parameter numels, expert mask, count); per run
    its low-precision-parameter mask; and the bytes the layers keep for good for their
    low-precision compute."""
    runs: list[tuple[bool, int]] = []
    for m in moe:
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1] + 1)
        else:
            runs.append((m, 1))
    out, low, low_state = [], [], 0.0
    for m, count in runs:
        sc = layers.model(m).constants(z)
        none = (False,) * len(sc.layer_numels)
        out.append((sc.layer_numels, sc.layer_expert or none, count))
        low.append(sc.layer_low_precision or none)
        low_state += count * float(sc.chunk("middle").lpstate1 or 0.0)
    return tuple(out), tuple(low), low_state


def chunk_cost(
    layers: Layers,
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    vp: int,
    moe: tuple[bool, ...] | None = None,
) -> ChunkCost:
    """Predicted costs of one chunk whose layers are of variants `moe` (per layer: an MoE
    layer?); by default the plan's own chunk."""
    z = sizes_for(shape, plan)
    kind = chunk_kind(plan, pp_rank, vp)
    if moe is None:
        moe = layers.chunk(plan.chunk_starts(pp_rank)[vp], plan.chunks_of(pp_rank)[vp])
    k = len(moe)
    rc = plan.recompute
    n = min(rc.layers_on(pp_rank), k) if rc.granularity == "full" else 0
    costs, (ret, ret_grad) = _costs(layers, z, kind, moe, n, rc.method)
    moved = plan.ddp.activation_offload
    variants = _offloaded(layers, shape, kind, moe) if moved.groups else ()
    each = {m: layers.model(m).constants(z) for m in set(variants)}
    own = [each[m] for m in variants]
    per_layer = [offload.layer_bytes(sc, moved) for sc in own]
    inp, saved, fwd, bwd, redone = offload.chunk_adjusted(costs, per_layer)
    bwd += wgrad_hold(shape, plan, moe)  # --delay-wgrad-compute's queued inputs
    ends = layers.main.constants(z)
    kinds = [layers.model(m).constants(z).chunk(kind) for m in sorted(set(moe))]
    step, buffers = _step_buffers(layers, z, shape.dtype, kind, moe)
    pre, post = _ends(ends, kind, shape.mtp_num_layers > 0)
    runs, low, low_state = _runs(layers, z, moe)
    count = len(pre) + sum(c * len(numels) for numels, _, c in runs) + len(post)
    shared = _shared_end(kind, shape, plan, count)
    dp = (plan.dp * plan.cp, plan.expert_dp)
    bucket = _bucket_size(plan, pp_rank, vp, pre, runs, post)
    expert = ends.chunk(kind).end_expert[len(pre) :]  # an MTP layer's experts
    st = layer_static(
        pre, runs, post, shape.dtype, dp, plan.distributed_optimizer, shared, expert, plan.ddp,
        bucket, low,
    )  # fmt: skip
    alone, gathered, parts, foreach = 0.0, (0.0, 0.0), (pre, runs, post, expert), 0.0
    state = _routing_state(layers, z, kinds[-1], moe, shape.mtp_num_layers) if kinds else 0.0
    if plan.ddp.fsdp.enabled:  # Megatron-FSDP (Adam): capture_megatron.forecast.fsdp
        passes = fsdp.Passes(fwd, bwd, saved)
        whole = (plan.tp, plan.expert_tp) if layers.full_moments else None
        f = fsdp.chunk_state(plan.ddp, shape.dtype, parts, dp, kind, bucket, passes, whole)
        st, fwd, bwd, state = f.static, f.forward, f.backward, state + f.buffers
    elif plan.ddp.optimizer.optimizer != "adam":  # SGD, Muon: capture_megatron.forecast.optimizers
        rows = (shape.dtype, plan.tp, shape.padded_vocab(plan.tp) // plan.tp * shape.hidden_size)
        temp = optimizers.ADAM_TEMP if layers.torch_adam else 0
        st, step, gathered = optimizers.chunk_state(
            plan.ddp.optimizer, st, step, parts, rows, dp, temp
        )
    else:  # Adam: the precision-aware optimizer's, torch's single-tensor or foreach step
        step, alone, foreach = optimizers.adam_step(plan.ddp, st, step, layers)
    state += sum(moe.count(m) * float(c.lbuf1 or 0.0) for m, c in zip(sorted(set(moe)), kinds))
    return ChunkCost(
        kind, k, inp + saved, inp, fwd, bwd, step, st.params + round(low_state), st.grads,
        st.optimizer, buffers, redone, ret, ret_grad, state, st.copies + foreach, alone, st.host,
        offload.kept_bytes(own, moved), sum(per_layer), gathered,
    )  # fmt: skip


def _offloaded(
    layers: Layers, shape: ModelShape, kind: str, moe: tuple[bool, ...]
) -> tuple[bool, ...]:
    """Per transformer layer whose --offload-modules groups a chunk offloads, in forward order,
    whether it is an MoE layer: its decoder layers (`moe`), then on the last stage its MTP
    layers, whose inner TransformerLayer (built from the model's last layer's spec) offloads the
    same groups (megatron-core 0.16.1 transformer_layer.py; multi_token_prediction.py)."""
    if kind not in ("last", "only") or not shape.mtp_num_layers:
        return moe
    return (*moe, *layers.chunk(shape.num_layers - 1, 1) * shape.mtp_num_layers)


def _routing_state(
    layers: Layers, z: Sizes, own: KindConstants, moe: tuple[bool, ...], mtp: int
) -> float:
    """What the chunk's MoE token dispatchers keep for good: the one-layer probe's per MoE layer
    (`own`: the MoE variant's constants of the chunk's kind); with MTP layers (`mtp`) one middle
    layer's per further MoE layer, as the one-layer probe of a last / only chunk holds an MTP
    layer's dispatcher too."""
    if not any(moe):
        return 0.0
    if not mtp:
        return moe.count(True) * float(own.state1 or 0.0)
    one = float(layers.model(True).constants(z).chunk("middle").state1 or 0.0)
    return (moe.count(True) - 1) * one + float(own.state1 or 0.0)


def _step_buffers(
    layers: Layers, z: Sizes, dtype: str, kind: str, moe: tuple[bool, ...]
) -> tuple[float, float]:
    """(the optimizer step's peak beyond the step copies, persistent buffers) of a chunk. The
    probes measure the step of a one-layer chunk (none for an end alone) with Megatron-LM's
    default gradient buffers: where those are 16-bit (fp16 training) the measured peak holds
    that probe chunk's fp32 gradient copies, which are taken out here (the chunk's own are
    StaticBytes.copies). Fake-tensor probes do not run the step (0)."""
    default = layout_of(dtype, DdpOptions(), 1, False).copies
    if not moe and kind == "middle":  # an empty middle chunk: the one-layer probe's
        return _net_step(layers, layers.main.constants(z), kind, 1, default), 0.0
    if not moe:
        c = layers.main.constants(z).chunk(kind)
        return _net_step(layers, layers.main.constants(z), kind, 0, default), c.buffers_ends
    consts = [layers.model(m).constants(z) for m in sorted(set(moe))]
    step = max(_net_step(layers, sc, kind, 1, default) for sc in consts)
    return step, max(sc.chunk(kind).buffers1 for sc in consts)


def _net_step(layers: Layers, sc: ShapeConstants, kind: str, k: int, per_element: int) -> float:
    """A probe's measured step peak (k: 0 or 1 layer) less what depends on the run's gradient
    buffers and sharding: the gradient copies it holds and Adam's temporaries for its largest
    parameter (the probes run with DP 1, without the distributed optimizer); 0 for probes that did
    not run the step. chunk_cost adds the run's own (the difference alone can be negative)."""
    if not layers.step_measured:
        return 0.0
    c = sc.chunk(kind)
    measured = c.step1 if k else c.step_ends
    numels = (*c.end_numels, *(sc.layer_numels if k else ()))
    adam = optimizers.ADAM_TEMP * max(numels, default=0) if layers.torch_adam else 0
    if layers.foreach_adam:  # the probe's own foreach temporaries (chunk_cost adds the rank's)
        adam = FOREACH_ADAM_BYTES * sum(numels)
    return measured - per_element * sum(numels) - adam


def _bucket_size(
    plan: ParallelPlan,
    pp_rank: int,
    vp: int,
    pre: tuple[int, ...],
    runs: tuple[LayerRun, ...],
    post: tuple[int, ...],
) -> int | None:
    """DDP's bucket size for this chunk: only the first pipeline stage's first chunk buckets
    (megatron-core's DDP: disable_bucketing for later chunks, none on later stages); with
    --ddp-num-buckets sized by the rank's parameters (this chunk's: one chunk per rank, which
    DdpOptions.plan_problems requires)."""
    if pp_rank or vp:
        return None
    params = sum(pre) + sum(k * sum(numels) for numels, _, k in runs) + sum(post)
    return plan.ddp.bucket_size(plan.dp * plan.cp, params)


def _ends(sc: ShapeConstants, kind: str, mtp: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Parameter element counts before and after the layers, in module order: the embedding's
    tensors first; the final norm, the MTP layers and the output layer last (`mtp`: the last
    stage holds the embedding too)."""
    ends = tuple(sc.chunk(kind).end_numels)
    if kind == "first":
        return ends, ()
    if kind == "last" and not mtp:
        return (), ends
    if kind in ("only", "last"):
        head = len(sc.chunk("first").end_numels)
        return ends[:head], ends[head:]
    return (), ()


def _shared_end(kind: str, shape: ModelShape, plan: ParallelPlan, count: int) -> str | None:
    """Which end holds the embedding copy that DDP gives its own bucket (tied weights with PP > 1;
    with multi-token prediction, tied or not, the first stage's embedding and the last stage's
    copy of it, which megatron-core keeps equal over the embedding group)."""
    mtp = shape.mtp_num_layers > 0
    if (shape.untie_embeddings_and_output_weights and not mtp) or plan.pp == 1 or count == 0:
        return None
    return {"first": "pre", "last": "pre" if mtp else "post"}.get(kind)
