"""The combined 1F1B schedule of --overlap-moe-expert-parallel-comm at PP 1 (pure Python).

megatron-core 0.16.1 (MC pipeline_parallel/combined_1f1b.py
combined_1f1b_schedule_for_no_pipelining, models/common/model_chunk_schedule_plan.py
TransformerModelChunkSchedulePlan.run) runs micro-batch 0's forward alone, then for i = 1 .. m-1 one
step that merges micro-batch i's forward with micro-batch i-1's backward, then the last backward
alone. One merged step, in program order (the allocator's order; a second CUDA stream and events
change no allocated byte, MEMORY_MODEL.md):

1. i's embedding (pre_process forward): its output, one hidden state `e`, stays alive;
2. i-1's output layer and loss backward (post_process backward): the standard backward's head,
   with `e` beside it; it frees the head's saved tensors `H`;
3. per layer j: i's layer j forward interleaved with i-1's layer L-1-j backward, node by node
   (attention, dispatch, experts, combine); i-1 has freed j layers and i has saved j, so every
   moment holds the standard chunk's saved bytes less `H`, plus `e`, plus at most one layer's
   saved `S` of i's running layer and one layer's backward transient, or i's running layer's
   forward peak;
4. i's output layer and loss forward (post_process forward) while i-1 still holds its embedding
   gradient `e` (pre_process backward runs after it).

Each node detaches its inputs; those that free their input after the forward (MoE dispatch,
experts, combine: fine_grained_callables.should_free_input) hold nothing the plain forward would
not, and the nodes' kept outputs are tensors the next node saves anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.predict.layers import Layers, sizes_for


@dataclass(frozen=True)
class Merged:
    """What the combined 1F1B schedule adds to a PP 1 rank's moments (bytes)."""

    hidden: float
    """`e`: one hidden state between layers ([s/CP x b (/TP with SP), h]): the next
    micro-batch's embedding output during the head backward, the previous one's embedding
    gradient during the head forward."""
    layer_step: float
    """Above the chunk's saved bytes less the head's (`H`): the worst node of a merged layer step,
    max(S + a layer's backward peak, a layer's forward peak) over the chunk's layer variants."""
    head: float
    """`H`: what the output layer, final norm and loss save, freed before the layer steps."""


def merged(layers: Layers, shape: ModelShape, plan: ParallelPlan) -> Merged | None:
    """The merged-step terms of a PP 1 plan with --overlap-moe-expert-parallel-comm and at least
    two micro-batches (None otherwise: the schedule runs no merged step)."""
    if not plan.ddp.overlap_moe_expert_parallel_comm or plan.pp > 1:
        return None
    if plan.num_microbatches < 2:
        return None
    z = sizes_for(shape, plan)
    moe = layers.chunk(0, plan.num_layers) if layers.mixed else (True,)
    step, hidden = 0.0, 0.0
    for m in sorted(set(moe)):
        sc = layers.model(m).constants(z)
        mid = sc.chunk("middle")
        step = max(step, sc.layer_saved + mid.bwd1, mid.fwd1)
        hidden = max(hidden, mid.input_bytes)
    ends = layers.main.constants(z)
    head = ends.chunk("only").need("saved0") - ends.chunk("first").need("saved0")
    return Merged(hidden=hidden, layer_step=step, head=max(head, 0.0))


def merged_transient(kind: str, transient: float, backward: float, m: Merged) -> float:
    """A moment's transient under the combined schedule: a forward ("F") holds the previous
    micro-batch's embedding gradient besides; a backward ("B") is the worse of its head (the
    standard backward peak, with the next micro-batch's embedding output) and a merged layer step
    (which runs with the head's saved bytes freed)."""
    if kind == "F":
        return transient + m.hidden
    if kind == "B":
        return transient - backward + max(backward, m.layer_step - m.head) + m.hidden
    return transient
