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
flag (capture_megatron.forecast.wgrad): an upper bound, as a node's own peak (the
attention core's backward, the experts' activation backward) does not always fall where all of
its queued tensors are alive. 16-bit tensors (the overlap needs bf16 or fp16; in a 1-byte format TE
queues the quantized inputs, which this counts at 2 bytes too).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def gemm_pair(rows: int, hidden: int, width: int, gated: bool) -> int:
    """Elements two GEMMs h -> width (x 2 gated) -> h queue for `rows` rows: fc1's input and
    output gradient, fc2's input and output gradient."""
    up = (2 if gated else 1) * width
    return rows * (hidden + up) + rows * (width + hidden)


def hold(
    rows: int, hidden: int, attention: tuple[int, int], mlp: tuple[int, int, bool], shared: int
) -> WgradHold:
    """The queued bytes of one layer: `rows` gathered rows (s x b / CP), `attention` (QKV width,
    output projection's input width, both per TP rank), `mlp` (rows, width per rank, gated) of
    its dense MLP or routed experts, `shared` the shared experts' width per TP rank (0: none)."""
    qkv, proj = attention
    queue = rows * (hidden + qkv) + rows * (proj + hidden)
    if shared:
        queue += gemm_pair(rows, hidden, shared, mlp[2])
    return WgradHold(ELEMENT * queue, ELEMENT * gemm_pair(mlp[0], hidden, mlp[1], mlp[2]))
