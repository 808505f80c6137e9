"""--delay-wgrad-compute: what delayed weight-gradient computation keeps (pure Python).

megatron-core 0.16.1 runs it only inside the combined 1F1B schedule of
--overlap-moe-expert-parallel-comm (TransformerConfig asserts the overlap; Megatron-LM asserts
--transformer-impl transformer_engine). Each Transformer Engine layer built with
delay_wgrad_compute computes only its input gradient in backward and queues what its weight
gradient needs -- its input (the sequence-parallel all-gather of it for a column-parallel layer,
re-gathered in backward as TE does) and its output gradient (all-gathered for a row-parallel layer
under sequence parallelism) -- in its wgrad store until backward_dw pops it (TE module/base.py
WeightGradStore). megatron-core's layer nodes (models/gpt/fine_grained_callables.py
TransformerLayerNode.backward_impl, backward_dw; models/common/model_chunk_schedule_plan.py
TransformerLayerSchedulePlan.run) call backward_dw:
- the experts node (`mlp`): right after its backward, before the dispatch's backward, with the
  forward of the merged micro-batch's dispatch in between: until then it holds every expert GEMM's
  input and output gradient, and the node's output gradient (backward_impl keeps `grads`);
- the attention node (`attn`): after its backward (the chunk's first layer after the pipeline's
  send of the input gradient), with the shared experts' weight gradients (_BackwardDWWrapper): until
  then it holds the attention projections' and the shared experts' inputs and output gradients.
So a layer's backward holds at its peak, beyond what a standard backward holds, the larger of the
two nodes' queued tensors. The forecast adds that to every layer backward of a plan with the
flag (capture_megatron.forecast.overlap.wgrad_hold): an upper bound, as a node's own peak (the
attention core's backward, the experts' activation backward) does not always fall where all of
its queued tensors are alive. 16-bit tensors (the overlap needs bf16 or fp16; under FP8 TE queues
the quantized inputs, which this counts at 2 bytes too).
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan

ELEMENT = 2
"""Bytes per element of the queued tensors (bf16 / fp16)."""


@dataclass(frozen=True)
class WgradHold:
    """Bytes a layer's backward holds beyond a standard backward with --delay-wgrad-compute."""

    attention: int
    """The attention node's queue: QKV (gathered input, output gradient), the output projection
    (input, gathered output gradient), and the shared experts' two GEMMs, until its
    backward_dw."""
    mlp: int
    """The MLP / experts node's queue: both GEMMs' inputs and output gradients, until its
    backward_dw."""

    @property
    def peak(self) -> int:
        """What the layer's backward holds at most (the nodes' queues never overlap: the experts'
        backward_dw runs before the attention's backward)."""
        return max(self.attention, self.mlp)


def hold(shape: ModelShape, plan: ParallelPlan, moe_layer: bool, factor: float) -> WgradHold:
    """The queued bytes of one layer (an MoE layer when `moe_layer`) under `plan`, its routed
    experts receiving `factor` x their balanced share (the routing forecast)."""
    t = plan.tp
    full = shape.seq_length * plan.micro_batch_size // plan.cp  # gathered rows
    h = shape.hidden_size
    heads, groups, d = shape.num_attention_heads, shape.groups, shape.head_dim
    qkv = (heads + 2 * groups) * d // t
    proj = heads * d // t
    attention = full * (h + qkv) + full * (proj + h)
    if moe_layer and shape.moe.enabled:
        moe = shape.moe
        shared = moe.moe_shared_expert_intermediate_size // t
        if shared:
            gate = 2 if shape.gated else 1
            attention += full * (h + gate * shared) + full * (shared + h)
        rows = _expert_rows(shape, plan, factor)
        f = shape.moe_ffn // plan.expert_tp
        up = (2 if shape.gated else 1) * f
        mlp = rows * (h + up) + rows * (f + h)
    else:
        f = shape.ffn // t
        up = (2 if shape.gated else 1) * f
        mlp = full * (h + up) + full * (f + h)
    return WgradHold(ELEMENT * attention, ELEMENT * mlp)


def _expert_rows(shape: ModelShape, plan: ParallelPlan, factor: float) -> int:
    """Rows of a rank's expert GEMMs: its tokens (the layer's input on a rank, sequence-parallel
    over TP) times top-k, over its expert tensor-parallel copies, at the routing factor."""
    tokens = shape.seq_length * plan.micro_batch_size // (plan.cp * plan.tp)
    return round(tokens * plan.expert_tp * shape.moe.moe_router_topk * factor)
