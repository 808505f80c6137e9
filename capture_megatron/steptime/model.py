"""Estimated step time of a plan, with the structure of a Megatron step (the `throughput` objective
ranks plans by it; predict and plan print it). Pure Python, fast: the search calls it for every
candidate.

Per pipeline rank and model chunk, one micro-batch's forward and backward (capture_megatron.planner.
costparts: GEMMs at an efficiency that falls as the per-GPU matrices shrink, the attention core,
memory-bound kernels, TP / CP / EP communication left exposed; full recompute re-runs a layer's
forward, selective the modules of --recompute-modules). The pipeline takes m x the slowest rank's
micro-batch time plus the other ranks' share of the fill and drain (the bubble from the stages' real
times; / v when interleaved), plus the pipeline sends it cannot overlap. Then the data-parallel
gradient reduce (and the distributed optimizer's parameter all-gather): sized from the real
parameter count in the gradient dtype, over NVLink or the network as Megatron places the ranks,
hidden by the backward (forward) as --overlap-grad-reduce (--overlap-param-gather) say; and the
optimizer step, bytes of parameters and state over HBM. The constants are fitted to published H100
step times (capture_megatron.steptime.constants, bench/step_time.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.steptime import fsdp, launch
from capture_megatron.steptime import parts as cp
from capture_megatron.steptime.constants import Constants, fitted
from capture_megatron.steptime.flops import model_flops
from capture_megatron.steptime.hardware import Hardware
from capture_megatron.steptime.kernels import Parts
from capture_megatron.steptime.offload import device_share, host_step_seconds
from capture_megatron.steptime.settings import StepSettings


@dataclass(frozen=True)
class CostModel:
    """What the step-time estimate assumes: the hardware, the run's overlap settings, and the
    model's constants (the shipped fit unless given)."""

    hardware: Hardware = Hardware()
    """The accelerator and its links (--gpu-type and overrides)."""
    settings: StepSettings = StepSettings()
    """Overlap and gradient precision of the run."""
    constants: Constants = field(default_factory=fitted)
    """Fitted constants (capture_megatron.steptime.constants)."""

    @property
    def setting(self) -> cp.Setting:
        """The three together, as the pieces take them."""
        return cp.Setting(self.hardware, self.settings, self.constants)


@dataclass(frozen=True)
class ChunkTime:
    """One model chunk (virtual stage) on one pipeline rank, per micro-batch."""

    pp_rank: int
    """Pipeline rank holding the chunk."""
    chunk: int
    """Index of the chunk on that rank (0 .. vpp - 1)."""
    layers: int
    """Transformer layers in the chunk."""
    forward: float
    """Forward seconds (embedding / head included where the chunk holds them)."""
    backward: float
    """Backward seconds, recompute included."""
    parts: Parts = Parts()
    """forward + backward by where the seconds go (capture_megatron.steptime.breakdown)."""


@dataclass(frozen=True)
class StepTime:
    """The estimate of one optimizer step, broken down."""

    seconds: float
    """Estimated seconds per optimizer step."""
    chunks: tuple[ChunkTime, ...]
    """Per-micro-batch time of every (pipeline rank, chunk), ranks in order."""
    pipeline: float
    """Forward and backward of every micro-batch, with the pipeline bubble."""
    bubble: float
    """The part of `pipeline` spent filling and draining (the stages' real times)."""
    p2p: float
    """Pipeline sends left exposed."""
    data_parallel: float
    """Gradient reduce and parameter all-gather left exposed (and the tied embedding's)."""
    optimizer: float
    """The optimizer step (memory-bound)."""
    model_flops: float
    """Model FLOPs of one step (forward + backward, no recompute; NVIDIA's MFU convention)."""
    tokens: int
    """Tokens per step (global batch x sequence)."""
    gpus: int
    """GPUs of the plan."""
    peak_flops: float
    """Dense bf16 FLOP/s of one GPU (the hardware's)."""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Training throughput per GPU."""
        return self.tokens / self.seconds / self.gpus

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU."""
        return self.model_flops / self.seconds / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOP/s per GPU over its peak."""
        return self.model_flops / self.seconds / self.gpus / self.peak_flops


def pipeline_seconds(
    rank_times: Sequence[float],
    microbatches: int,
    vpp: int = 1,
    slowest_chunks: Sequence[float] | None = None,
) -> float:
    """Seconds of the forward and backward of `microbatches` micro-batches through pipeline ranks
    whose per-micro-batch times (all their chunks) are `rank_times`: m x the slowest rank, plus
    the others' fill and drain. The fill and drain wait on each other rank for one pass of its
    slowest chunk (`slowest_chunks`, one per rank; by default its time / vpp, equal chunks): 1F1B's
    bubble (p - 1) t for equal stages, (p - 1) t / v interleaved over equal chunks, and up to the
    whole rank's time when one chunk holds all its layers."""
    slowest = max(range(len(rank_times)), key=lambda r: rank_times[r])
    chunks = slowest_chunks or [t / vpp for t in rank_times]
    return microbatches * rank_times[slowest] + sum(chunks) - chunks[slowest]


def _recomputed(plan: ParallelPlan, rank: int, chunk_layers: int) -> int:
    """Layers of a chunk that full recompute re-runs."""
    n = min(plan.recompute.layers_on(rank), chunk_layers)
    return chunk_layers if n and plan.recompute.method == "uniform" else n


def chunk_seconds(
    kinds: Sequence[cp.LayerTime],
    redo: int,
    selective: bool,
    head: tuple[float, float] | None,
    overhead: float,
) -> tuple[float, float]:
    """(forward, backward) seconds of one chunk of layers timed `kinds`, the first `redo` of them
    fully recomputed (their forward again in the backward), selective recompute's modules'
    forward again, the output layer and loss where the chunk holds them (`head`), and the
    schedule's overhead per pass."""
    fwd = sum(x.forward for x in kinds)
    bwd = sum(x.backward for x in kinds)
    bwd += sum(x.forward for x in kinds[:redo])
    if selective:
        bwd += sum(x.recomputed_forward for x in kinds)
    if head is not None:
        fwd, bwd = fwd + head[0], bwd + head[1]
    return fwd + overhead, bwd + overhead


def chunk_parts(
    kinds: Sequence[cp.LayerTime],
    redo: int,
    selective: bool,
    head: cp.LayerTime | None,
    overhead: float,
) -> Parts:
    """chunk_seconds' forward + backward by where the seconds go (the same arguments, the head
    with its parts)."""
    total = Parts(overhead=2 * overhead)
    for x in kinds:
        total = total + x.parts
    again = sum(x.forward for x in kinds[:redo])
    again += sum(x.recomputed_forward for x in kinds) if selective else 0.0
    total = total + Parts(recompute=again)
    return total + head.parts if head is not None else total


def overhead_per_pass(model: CostModel) -> float:
    """The schedule's host seconds per chunk pass (none when one CUDA graph replays the whole
    step)."""
    s = model.setting
    return 0.0 if launch.full_iteration(s) else s.k.chunk_overhead


def chunk_times(
    shape: ModelShape, plan: ParallelPlan, model: CostModel, broken_down: bool = True
) -> tuple[ChunkTime, ...]:
    """Per-micro-batch forward / backward seconds of every (pipeline rank, chunk) of the plan
    (layer by layer: dense and MoE layers as the model places them), with their parts unless not
    `broken_down` (the seconds alone: what the planner ranks plans by)."""
    s = model.setting
    dense, moe = cp.layer_time(s, shape, plan), None
    if shape.moe.enabled:
        moe = cp.layer_time(s, shape, plan, moe=True)
    pattern = shape.moe_layers if moe is not None else ()
    head = cp.head(s, shape, plan)
    last_stage = plan.pp * plan.vpp - 1
    selective = plan.recompute.granularity == "selective"
    overhead = overhead_per_pass(model)
    out = []
    for r in range(plan.pp):
        for v, (start, k) in enumerate(zip(plan.chunk_starts(r), plan.chunks_of(r))):
            kinds = [
                moe if pattern and pattern[i] and moe is not None else dense
                for i in range(start, start + k)
            ]
            at_end = head if v * plan.pp + r == last_stage else None
            redo = _recomputed(plan, r, k)
            ends = (head.forward, head.backward) if at_end else None
            fwd, bwd = chunk_seconds(kinds, redo, selective, ends, overhead)
            parts = (
                chunk_parts(kinds, redo, selective, at_end, overhead) if broken_down else Parts()
            )
            out.append(ChunkTime(r, v, k, fwd, bwd, parts))
    return tuple(out)


def _rank_params(shape: ModelShape, plan: ParallelPlan, rank: int) -> tuple[float, float]:
    """(parameters reduced over DP x CP, routed-expert parameters reduced over the expert-data-
    parallel group) one GPU of pipeline rank `rank` holds: its layers, the embedding / output
    layer where its chunks hold them, the MTP layers on the last."""
    pattern = shape.moe_layers if shape.moe.enabled else ()
    dense = cp.layer_param_split(shape, plan, False)
    moe = cp.layer_param_split(shape, plan, True) if pattern else dense
    shared = routed = 0.0
    for start, k in zip(plan.chunk_starts(rank), plan.chunks_of(rank)):
        for i in range(start, start + k):
            kind = moe if pattern and pattern[i] else dense
            shared, routed = shared + kind[0], routed + kind[1]
    first, last = rank == 0, rank == plan.pp - 1
    if last and plan.mtp_layers:
        kind = moe if pattern and pattern[-1] else dense
        h = shape.hidden_size
        shared += plan.mtp_layers * (kind[0] + 2 * h * h / plan.tp + 2 * h)
        routed += plan.mtp_layers * kind[1]
    return shared + cp.end_params(shape, plan.tp, first, last), routed


def _p2p(shape: ModelShape, plan: ParallelPlan, model: CostModel) -> float:
    """Exposed seconds of the pipeline's sends: each micro-batch's activation (its gradient
    backward) crosses every stage boundary; the interleaved schedule overlaps them with compute
    except along the fill and drain, the 1F1B schedule waits for each."""
    p = plan.pp
    if p == 1:
        return 0.0
    s = model.setting
    sp = plan.tp if plan.sequence_parallel else 1
    nbytes = cp.tokens(shape, plan) / sp * shape.hidden_size * dtype_bytes(shape.dtype)
    bw = s.hw.link_bytes_per_s(0, 2, plan.tp * plan.cp * plan.dp) * s.k.link_efficiency
    hops = 2 * (p - 1)
    if not (plan.vpp > 1 and model.settings.overlap_p2p_comm):
        hops += 2 * plan.num_microbatches * plan.vpp
    return hops * nbytes / bw


def _dp_collectives(
    shape: ModelShape, plan: ParallelPlan, model: CostModel, params: float, expert: float = 0.0
) -> tuple[tuple[float, bool], tuple[float, bool]]:
    """((seconds, overlapped) of a rank's gradient reduce (reduce-scatter with the distributed
    optimizer, else all-reduce), the same of the distributed optimizer's parameter all-gather (0
    without it)) of its `params` over DP x CP and its routed-expert `expert` parameters over the
    expert-data-parallel group; overlapped as --overlap-grad-reduce and --overlap-param-gather
    say. Megatron-FSDP: what its strategy leaves to the step (capture_megatron.steptime.fsdp)."""
    s, run = model.setting, model.settings
    given = fsdp.step_collectives(plan)
    sharded = plan.distributed_optimizer if given is None else given[1]
    passes = (1 if plan.distributed_optimizer else 2) if given is None else given[0]
    reduce = gather = 0.0
    groups = (
        (params, plan.dp * plan.cp, plan.tp),
        (expert, plan.expert_dp, plan.ep * plan.expert_tp),
    )
    for n, ranks, stride in groups:
        if ranks == 1 or n <= 0:
            continue
        bw = s.hw.link_bytes_per_s(0, ranks, stride)
        if passes:
            reduce += cp.ring(s, n * _grad_bytes(shape, plan), ranks, bw, passes)
        if sharded:
            gather += cp.ring(s, n * dtype_bytes(shape.dtype), ranks, bw)
    return (reduce, run.overlap_grad_reduce), (gather, run.overlap_param_gather and sharded)


def _exposed(model: CostModel, seconds: float, overlapped: bool, window: float) -> float:
    """What a collective of `seconds` leaves exposed behind a `window` when overlapped (never
    less than dp_overlap_exposed of it), all of it otherwise."""
    floor = model.setting.k.dp_overlap_exposed * seconds
    return max(floor, seconds - window) if overlapped else seconds


def _data_parallel(
    shape: ModelShape,
    plan: ParallelPlan,
    model: CostModel,
    params: tuple[float, float],
    fwd: float,
    bwd: float,
) -> float:
    """Exposed seconds of a rank's data-parallel collectives (_dp_collectives) of its (DP x CP,
    expert) `params`: the overlapped gradient reduce hides behind the last micro-batch's backward
    `bwd`, the parameter gather behind the first one's forward `fwd`, except dp_overlap_exposed
    of them."""
    (reduce, grads), (gather, params_) = _dp_collectives(shape, plan, model, *params)
    return _exposed(model, reduce, grads, bwd) + _exposed(model, gather, params_, fwd)


def _grad_bytes(shape: ModelShape, plan: ParallelPlan) -> int:
    """Bytes per gradient element: the gradient buffers' dtype (Megatron-LM's rule: fp32 for bf16
    runs unless --grad-reduce-in-bf16, ...; DdpOptions.grad_dtype)."""
    return dtype_bytes(plan.ddp.grad_dtype(shape.dtype))


def _optimizer(
    shape: ModelShape, plan: ParallelPlan, model: CostModel, params: float, expert: float = 0.0
) -> float:
    """Seconds of a rank's Adam step over its `params` and routed-expert `expert` parameters:
    fp32 master weights and moments read and written, gradients read (twice, with the norm for
    clipping), 16-bit weights written, the gradient buffer zeroed; over its 1 / (DP x CP) share
    (the experts' 1 / expert-DP share) with the distributed optimizer or a sharding Megatron-FSDP;
    with --optimizer-cpu-offload the moved share's transfers and host Adam instead
    (capture_megatron.steptime.offload)."""
    s, grad = model.setting, _grad_bytes(shape, plan)
    owned = params + expert
    if fsdp.shards_optimizer(plan):
        owned = params / (plan.dp * plan.cp) + expert / plan.expert_dp
    params += expert
    kept = owned * device_share(plan)  # --optimizer-cpu-offload: the rest on the host
    nbytes = kept * (24 + 2 * grad + dtype_bytes(shape.dtype)) + params * grad
    device = nbytes / (s.hw.hbm_bytes_per_s * s.k.memory_efficiency)
    return device + host_step_seconds(shape, plan, s.hw, owned)


def _tied_embedding(shape: ModelShape, plan: ParallelPlan, model: CostModel) -> float:
    """The all-reduce of a tied embedding's gradient between the first and last stage."""
    if plan.pp == 1 or shape.untie_embeddings_and_output_weights:
        return 0.0
    s = model.setting
    nbytes = shape.padded_vocab(plan.tp) / plan.tp * shape.hidden_size * 4
    bw = s.hw.link_bytes_per_s(0, 2, plan.tp * plan.cp * plan.dp * (plan.pp - 1))
    return cp.ring(s, nbytes, 2, bw, passes=2)


def step_time(
    shape: ModelShape, plan: ParallelPlan, model: CostModel | None = None, broken_down: bool = True
) -> StepTime:
    """The estimated optimizer step of `plan`, broken down (see the module docstring; its chunks
    without their parts unless `broken_down`)."""
    model = model or CostModel()
    chunks = chunk_times(shape, plan, model, broken_down)
    fwd = [sum(c.forward for c in chunks if c.pp_rank == r) for r in range(plan.pp)]
    bwd = [sum(c.backward for c in chunks if c.pp_rank == r) for r in range(plan.pp)]
    params = [_rank_params(shape, plan, r) for r in range(plan.pp)]
    per_rank = [f + b for f, b in zip(fwd, bwd)]
    widest = [max(c.forward + c.backward for c in chunks if c.pp_rank == r) for r in range(plan.pp)]
    m = plan.num_microbatches
    pipeline = pipeline_seconds(per_rank, m, plan.vpp, widest)
    dp = max(_data_parallel(shape, plan, model, n, f, b) for n, f, b in zip(params, fwd, bwd))
    dp += _tied_embedding(shape, plan, model)
    optimizer = max(_optimizer(shape, plan, model, *n) for n in params)
    p2p = _p2p(shape, plan, model)
    return StepTime(
        seconds=pipeline + p2p + dp + optimizer,
        chunks=chunks,
        pipeline=pipeline,
        bubble=pipeline - m * max(per_rank),
        p2p=p2p,
        data_parallel=dp,
        optimizer=optimizer,
        model_flops=model_flops(shape, plan.global_batch_size),
        tokens=plan.global_batch_size * shape.seq_length,
        gpus=plan.world_size,
        peak_flops=model.hardware.peak_flops,
    )


def step_seconds(shape: ModelShape, plan: ParallelPlan, model: CostModel | None = None) -> float:
    """Estimated seconds per optimizer step (step_time; its lower bound over every layout and
    recompute setting of the plan's sizes: capture_megatron.planner.stepbound.step_bound)."""
    return step_time(shape, plan, model or CostModel(), broken_down=False).seconds


ROUNDING = 1 - 1e-12
"""Bounds are scaled by this: the same seconds summed in another order may round higher."""
