"""Fine-grained activation offloading (--fine-grained-activation-offloading) in a chunk's costs
and a rank's peak (pure Python). The rule, tensor by tensor: docs/MEMORY_MODEL.md,
"Fine-grained activation offloading".

Per layer, the bytes offloaded are the storages its --offload-modules groups save of at least
--min-offloaded-tensor-size elements (ProfileRecord.offload_tensors, measured through
megatron-core's own call sites). In the steady state (the iterations after the first, which
Megatron-LM's peak is) a micro-batch in flight holds them on the host; a chunk's forward has
moved its earlier layers' off the device by its last layer; its backward reloads each layer's
groups before their use, so the backward's peak holds the running layer's groups again. What
megatron-core keeps on the device (post_warmup_callback): the last group of each name of the
first chunk in backward order that has one, for one micro-batch: the rank's kept bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from capture_megatron.errors import CaptureError
from capture_megatron.features.activation_offload import ActivationOffload
from capture_megatron.fit import MemoryModel, ShapeConstants
from capture_megatron.forecast.mixed import Costs


def group_bytes(sc: ShapeConstants, offload: ActivationOffload) -> dict[str, float]:
    """Per offloaded group, the bytes one layer of these constants moves to the host."""
    if sc.layer_offload is None:
        raise CaptureError(
            "the memory model's records do not say what fine-grained activation offloading "
            "moves (profiled before capture-megatron measured it): profile the model again "
            "(a new --memory-model, or a fresh profiling cache)"
        )
    out = dict.fromkeys(offload.groups, 0.0)
    for row in sc.layer_offload:
        if row.group in out and row.numel >= offload.min_offloaded_tensor_size:
            out[row.group] += row.nbytes
    return out


def measured(model: MemoryModel) -> bool:
    """Whether the memory model's records say what fine-grained activation offloading moves
    (every model profiled since capture-megatron measures it; not a --memory-model file written
    before, nor one without probe records)."""
    return all(a.layer_offload is not None for v in model.variants for a in v.anchors)


def layer_bytes(sc: ShapeConstants, offload: ActivationOffload) -> float:
    """The bytes one layer of these constants moves to the host (0 when offloading is off)."""
    return sum(group_bytes(sc, offload).values()) if offload.groups else 0.0


def kept_bytes(layers: Sequence[ShapeConstants], offload: ActivationOffload) -> float:
    """What megatron-core keeps on the device of a chunk whose layers have these constants, when
    it is its rank's first chunk in backward order with groups: the last group of each name (one
    micro-batch's; per name the largest over the chunk's layer variants, an approximation where
    a chunk mixes dense and MoE layers)."""
    if not offload.groups or not layers:
        return 0.0
    per = [group_bytes(sc, offload) for sc in layers]
    return sum(max(g[name] for g in per) for name in offload.groups)


@dataclass(frozen=True)
class Kept:
    """What megatron-core keeps on a rank's device of one micro-batch under fine-grained
    activation offloading (kept_bytes): the last group of each name of its first chunk in
    backward order that has groups."""

    nbytes: float = 0.0
    """The kept groups' bytes (0 without offloading)."""
    chunk: int = 0
    """The local chunk whose micro-batch keeps them."""

    def at(self, kind: str, live: Sequence[int]) -> float:
        """The kept bytes on the device at a schedule moment (kind F, B, M or D; micro-batches
        alive per chunk before it): at a forward while a micro-batch of the keeping chunk is
        alive. Before that chunk's first forward nothing is kept yet, and while its first
        micro-batch runs its forward the groups are in that forward's own peak; at a backward
        the keeping chunk's reload term holds them."""
        return self.nbytes if kind == "F" and live[self.chunk] > 0 else 0.0


NONE_KEPT = Kept()
"""Kept without offloading."""


def rank_kept(kept: Sequence[float]) -> Kept:
    """Kept of a rank from its chunks' kept bytes (ChunkCost.offload_kept, in forward order):
    the last chunk that has groups is the first in backward order."""
    if not any(kept):
        return NONE_KEPT
    for chunk in reversed(range(len(kept))):
        if kept[chunk]:
            return Kept(kept[chunk], chunk)
    return NONE_KEPT


def chunk_adjusted(costs: Costs, per_layer: Sequence[float]) -> Costs:
    """(input, saved, forward peak, backward peak, recomputed) of a chunk under offloading, from
    its costs without it and the bytes each of its layers (in forward order) offloads: a
    micro-batch in flight holds its saved bytes less every layer's offloaded ones (the first
    layer's include the received input, which attn_norm frees by hand); the forward peak, reached
    in the last layer, no longer holds the earlier layers'; the backward peak, reached in the last
    layer, holds its groups again (reloaded one group ahead of their use)."""
    if not per_layer or not any(per_layer):
        return costs
    total, last = sum(per_layer), per_layer[-1]
    return costs._replace(
        saved=max(costs.input + costs.saved - total, 0.0) - costs.input,
        forward=max(costs.forward - (total - last), 0.0),
        backward=costs.backward + last,
    )
