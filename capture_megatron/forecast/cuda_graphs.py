"""CUDA graphs in the forecast: the static buffers a rank keeps once its graphs are captured
(capture_megatron.features.cuda_graphs; pure Python)."""

from __future__ import annotations

import numpy as np

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.features.cuda_graphs import static_input_bytes
from capture_megatron.forecast.schedule import ScheduleSpec, events


def graph_buffers(
    shape: ModelShape, plan: ParallelPlan, pp_rank: int, chunks: list[tuple[bool, ...]]
) -> float:
    """Bytes of the static buffers a pipeline rank's CUDA graphs keep for the run, its chunks
    holding these layers (per chunk, per layer: an MoE layer?): the static inputs of every
    captured (layer, micro-batch) forward in flight at once in the captured schedule (one
    micro-batch without pipelining; every micro-batch of the step in the schedule's order with PP
    or the EP overlap), one gradient-output buffer (a hidden state) and, with the attention
    graphed under RoPE, the rotary table; 0 without graphs."""
    graphs = plan.ddp.cuda_graphs
    if not graphs.enabled:
        return 0.0
    per_chunk = [sum(graphs.graphs_layer(m) for m in moe) for moe in chunks]
    per_chunk[-1] += _mtp_layers(shape, plan, pp_rank)
    return float(_bytes(shape, plan, pp_rank, np.asarray([[n] for n in per_chunk]))[0])


def plan_graph_buffers(shape: ModelShape, plan: ParallelPlan) -> float:
    """graph_buffers of the plan's own split, on its worst rank."""
    pattern = shape.moe.pattern(shape.num_layers)
    worst = 0.0
    for r in range(plan.pp):
        starts, counts = plan.chunk_starts(r), plan.chunks_of(r)
        chunks = [pattern[a : a + n] for a, n in zip(starts, counts)]
        worst = max(worst, graph_buffers(shape, plan, r, chunks))
    return worst


def graphs_note(shape: ModelShape, plan: ParallelPlan) -> str:
    """What the forecast makes of the plan's CUDA graphs ('' without them)."""
    g = plan.ddp.cuda_graphs
    if not g.enabled:
        return ""
    scope = " ".join(sorted(g.scopes)) or "whole layers"
    nbytes = plan_graph_buffers(shape, plan)
    return (
        f"CUDA graphs (--cuda-graph-impl {g.impl}, scope {scope}): the peaks hold the graphs' "
        f"static inputs from the start ({nbytes / 2**30:.2f} GiB on the worst rank: each "
        "captured (layer, micro-batch) forward in flight keeps its hidden states"
        + (" and causal mask" if g.graphs_attention() else "")
        + "); after the capture the graphed scopes' activations live in the graphs' private "
        "pool, reserved rather than allocated, within the peak shown (an upper bound by at most "
        "the static inputs; docs/MEMORY_MODEL.md)"
    )


def graph_buffer_table(
    shape: ModelShape, plan: ParallelPlan, pp_rank: int, limit: int
) -> np.ndarray | float:
    """graph_buffers for every chunk count 0..limit (plan.vpp dimensions; layers of one
    variant, the model's)."""
    grid = (limit + 1,) * plan.vpp
    rows = graph_buffer_rows(shape, plan, pp_rank, np.indices(grid).reshape(plan.vpp, -1).T)
    return rows if isinstance(rows, float) else rows.reshape(grid)


def graph_buffer_rows(
    shape: ModelShape, plan: ParallelPlan, pp_rank: int, splits: np.ndarray
) -> np.ndarray | float:
    """graph_buffers for each row of `splits` (chunk counts, one column per chunk; layers of one
    variant, the model's)."""
    graphs = plan.ddp.cuda_graphs
    if not graphs.enabled:
        return 0.0
    one = int(graphs.graphs_layer(shape.moe.enabled))
    per_chunk = splits.T.astype(np.int64) * one
    per_chunk[-1] += _mtp_layers(shape, plan, pp_rank)
    return _bytes(shape, plan, pp_rank, per_chunk)


def _mtp_layers(shape: ModelShape, plan: ParallelPlan, pp_rank: int) -> int:
    """The last stage's captured MTP layers (their inner layers are of the model's last layer's
    kind), on its last chunk."""
    if pp_rank != plan.pp - 1 or not shape.mtp_num_layers:
        return 0
    last = shape.moe.pattern(shape.num_layers)[-1]
    return shape.mtp_num_layers * int(plan.ddp.cuda_graphs.graphs_layer(last))


def _bytes(
    shape: ModelShape, plan: ParallelPlan, pp_rank: int, per_chunk: np.ndarray
) -> np.ndarray:
    """The buffers for each column of `per_chunk` (captured layers per local chunk)."""
    graphs = plan.ddp.cuda_graphs
    if plan.pp == 1 and not plan.ddp.overlap_moe_expert_parallel_comm:
        slots = per_chunk.sum(axis=0)
    else:
        slots = np.max([np.asarray(live) @ per_chunk for live in _lives(plan, pp_rank)], axis=0)
    attention = graphs.graphs_attention()
    one = static_input_bytes(
        shape.seq_length, plan.micro_batch_size, shape.hidden_size, plan.tp, plan.cp,
        plan.sequence_parallel, attention,
    )  # fmt: skip
    rows = shape.seq_length // plan.cp // (plan.tp if plan.sequence_parallel else 1)
    element = 4 if shape.dtype == "fp32" else 2
    grad_output = rows * plan.micro_batch_size * shape.hidden_size * element
    rope = shape.position_embedding_type == "rope"
    rotary = 4 * shape.seq_length * shape.head_dim if attention and rope else 0
    return np.where(slots > 0, slots * one + grad_output + rotary, 0).astype(np.float64)


def _lives(plan: ParallelPlan, pp_rank: int) -> set[tuple[int, ...]]:
    """The micro-batches alive per local chunk after each pass of the captured schedule
    (megatron's _get_sample_arguments reuses a signature's static inputs once a backward
    frees them, so a rank holds those of its forwards in flight)."""
    spec = ScheduleSpec(
        pp=plan.pp,
        num_microbatches=plan.num_microbatches,
        vpp=plan.vpp,
        microbatch_group_size=plan.microbatch_group_size,
        overlap=plan.ddp.overlap_moe_expert_parallel_comm,
    )
    live, out = [0] * plan.vpp, set()
    for ev in events(spec, pp_rank):
        live[ev.chunk] += 1 if ev.kind == "F" else -1
        out.add(tuple(live))
    return out
