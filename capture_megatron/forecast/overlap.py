"""The combined 1F1B schedule of --overlap-moe-expert-parallel-comm (pure Python).

megatron-core 0.16.1 (MC pipeline_parallel/combined_1f1b.py, models/common/
model_chunk_schedule_plan.py TransformerModelChunkSchedulePlan.run) merges a forward with a
backward of another micro-batch (PP 1: micro-batch i's forward with i-1's backward, after i = 0's
forward alone; interleaved: every steady-state pair, after one more warm-up forward:
capture_megatron.forecast.schedule). One merged step of forward chunk f and backward chunk b, in
program order (the allocator's order: the second CUDA stream and its events change no allocated
byte -- the caching allocator counts a block free when it is freed, its stream uses only delay
its reuse, c10/cuda/CUDACachingAllocator.cpp DeviceCachingAllocator::free):

1. f receives its input or runs its embedding (pre_process forward): one hidden state `e`;
2. b's output layer and loss backward, when b holds them (post_process backward): b's standard
   backward head with `e` beside it; it frees the head's saved tensors `H`;
3. per layer j: f's layer j forward interleaved with b's layer L-1-j backward, node by node
   (attention, dispatch, experts, combine); b has freed j layers and f has saved j, so every
   moment holds b's saved bytes less `H`, plus `e`, plus at most one layer's saved `S` of f's
   running layer and one layer's backward peak, or f's running layer's forward peak;
4. f's output layer and loss forward (post_process forward) once b's layers are done: b holds
   only its input gradient `e`.

Each node detaches its inputs; those that free their input after the forward (MoE dispatch,
experts, combine: fine_grained_callables.should_free_input) hold nothing the plain forward would
not, and the nodes' kept outputs are tensors the next node saves anyway. The schedule's moment
before a merged step (b's micro-batch alive, f's not yet) plus the worst of these is the step's
peak (capture_megatron.forecast.ranks). With --delay-wgrad-compute a layer's backward also holds
its nodes' queued weight-gradient inputs until their backward_dw (capture_megatron.forecast.wgrad).
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.forecast.chunks import ChunkCost
from capture_megatron.forecast.layers import Layers, sizes_for
from capture_megatron.forecast.wgrad import wgrad_hold


@dataclass(frozen=True)
class Merged:
    """The fitted terms of a plan's merged steps (bytes)."""

    hidden: float
    """`e`: one hidden state between layers ([s/CP x b (/TP with SP), h]): f's received input or
    embedding output during b's head backward, b's input gradient during f's head forward."""
    layer_step: float
    """Above b's saved bytes less its head's (`H`): the worst node of a merged layer step,
    max(S + a layer's backward peak, a layer's forward peak) over the chunks' layer variants."""
    heads: tuple[tuple[str, float], ...]
    """(chunk kind, `H`): what the output layer, final norm and loss save (last and only chunks),
    freed before the layer steps."""

    mtp: int = 0
    """MTP layers of the last stage (one more layer node each in its merged steps)."""

    def nodes(self, f_kind: str, b_kind: str) -> int:
        """The MTP layer nodes a merged step of chunks of these kinds runs."""
        return self.mtp * ((f_kind in ("last", "only")) + (b_kind in ("last", "only")))

    def head(self, kind: str) -> float:
        """`H` of a chunk kind (0 without the output layer)."""
        return dict(self.heads).get(kind, 0.0)


def merged(layers: Layers, shape: ModelShape, plan: ParallelPlan, kinds: tuple[str, ...]) -> Merged:
    """The merged-step terms of a rank whose chunks are of these kinds."""
    z = sizes_for(shape, plan)
    moe = set(layers.pattern) if layers.mixed else {True}
    step, hidden = 0.0, 0.0
    for m in sorted(moe):
        sc = layers.model(m).constants(z)
        mid = sc.chunk("middle")
        delayed = wgrad_hold(shape, plan, (m,))  # --delay-wgrad-compute's queued inputs
        step = max(step, sc.layer_saved + mid.bwd1 + delayed, mid.fwd1)
        hidden = max(hidden, mid.input_bytes)
    ends = layers.main.constants(z)
    # an MTP layer is one more layer node of the last stage, run after its decoder layers: the
    # head its backward frees first holds the output layer and loss, not the MTP layer's saved
    # bytes (those of one layer of the model's last layer's variant, as the MTP layer's inner
    # transformer layer is built from its spec)
    last = layers.chunk(shape.num_layers - 1, 1)[0]
    mtp = shape.mtp_num_layers * layers.model(last).constants(z).layer_saved
    heads = []
    for kind in sorted(set(kinds) & {"last", "only"}):
        h = ends.chunk(kind).saved_ends - mtp
        h -= ends.chunk("first").saved_ends if kind == "only" else 0.0
        heads.append((kind, max(h, 0.0)))
    return Merged(hidden=hidden, layer_step=step, heads=tuple(heads), mtp=shape.mtp_num_layers)


def merged_peak(m: Merged, f: ChunkCost, b: ChunkCost, f_retained: float) -> float:
    """A merged step's peak above the moment before it (b's micro-batch alive, f's not; the
    retention of f's chunk, `f_retained`, counted there): the worst of b's head backward (step
    2), a layer step (3) and f's head forward (4, b's saved bytes gone; f's forward peak holds
    its chunk's retention itself)."""
    head = b.backward + m.hidden
    nodes = f.layers + b.layers + m.nodes(f.kind, b.kind)
    steps = m.hidden - m.head(b.kind) + m.layer_step if nodes > 0 else 0.0
    tail = m.hidden + (f.input_bytes + f.forward) - b.inflight - f_retained
    return max(max(head, steps), tail)
