"""The search space: what the planner may choose (Space, with what the command line fixed) and
every candidate plan Megatron can run on a cluster (candidates). Pure Python."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from capture_megatron.config import Cluster, ModelShape, ParallelFlags, ParallelPlan, Recompute
from capture_megatron.config.ddp import DEFAULT_DDP, DdpOptions
from capture_megatron.config.kernels import Kernels
from capture_megatron.config.parallel import tp_fits
from capture_megatron.errors import CaptureError
from capture_megatron.features.dispatch import DEEPEP_GROUPS
from capture_megatron.flags.resolve import (
    given_modules,
    granularity_of,
    refuse_both_vpp,
    refuse_dropped_recompute,
)
from capture_megatron.planner.offload_space import (
    activation_ddp,
    fixed_offload,
    fixed_optimizer,
    offload_ddp,
)
from capture_megatron.rules.megatron import mtp_problems
from capture_megatron.rules.modelled import tp_overlap_problem


@dataclass(frozen=True)
class Space:
    """What the search may choose; a one-element tuple fixes a value (given on the command line)."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    """Tensor-parallel sizes (kept within a node)."""
    pp: tuple[int, ...] = ()
    """Pipeline sizes; empty: every size up to the layer count."""
    vpp: tuple[int, ...] = ()
    """Virtual stages per pipeline rank; empty: every count the layers allow (PP x VPP virtual
    stages of at least one layer each on average, the interleaved schedule's micro-batch rule)."""
    layers_per_virtual_stage: int = 0
    """--num-layers-per-virtual-pipeline-stage as given (0: not given): each PP candidate's VPP
    is then the layers per pipeline stage over it (Megatron-LM's rule), PP candidates whose
    stages it does not divide are skipped."""
    micro_batch_size: tuple[int, ...] = ()
    """Micro-batch sizes; empty: every power of two that divides the global batch over DP (memory
    stops the search: a size whose next smaller twin does not fit is not tried)."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    """Recompute granularities."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence parallelism (only with TP > 1)."""
    distributed_optimizer: tuple[bool, ...] = (False, True)
    """Megatron's distributed optimizer (only with DP > 1)."""
    recompute_modules: tuple[str, ...] = ()
    """--recompute-modules as given (the deprecated --moe-layer-recompute's 'moe' added; empty:
    megatron-core's default, core_attn), recomputed by every selective candidate."""
    recompute_method: str = ""
    """Full recompute's method as given (block or uniform); empty: block, counts searched."""
    recompute_layers: tuple[int, ...] = ()
    """Full recompute's layer counts as given: one n (--recompute-num-layers) or one per pipeline
    stage; empty: the planner chooses per-stage block counts."""
    cp: tuple[int, ...] = ()
    """Context-parallel sizes; empty: on GPUs, for sequences of at least CP_FROM tokens, every size
    that divides the GPUs over TP and the sequence into 2 x CP parts, else 1 (the GPU kernel set
    models TE's ring algorithm, the CPU one the all-gather)."""
    cp_comm_type: str = ""
    """--cp-comm-type as given ('' when not), kept in every candidate with CP > 1."""
    ep: tuple[int, ...] = ()
    """Expert-parallel sizes; empty: for a model with experts every size Megatron allows (it
    divides the experts and the TP x DP ranks of a stage over the expert TP), else 1."""
    etp: int = 0
    """The expert tensor-parallel size as given (--expert-tensor-parallel-size), kept in every
    candidate; 0: the candidate's TP (Megatron's default)."""
    ddp: DdpOptions = DdpOptions()
    """Gradient and optimizer-state settings as given, kept in every candidate (those megatron
    refuses with them are skipped)."""
    optimizer_offload: tuple[float, ...] = ()
    """Optimizer CPU offload fractions (--optimizer-offload-fraction); 0: no offload. A fraction
    above 0 turns on --optimizer-cpu-offload with --use-precision-aware-optimizer at its default
    fp32 dtypes (Megatron-LM's rule; HybridDeviceOptimizer takes none of its dtypes, so no byte
    changes) and the distributed optimizer. Empty: the planner's choice
    (plan.planner.searched_options: on GPUs OFFLOAD_FRACTIONS for min-gpus and throughput, none
    for min-peak), else none."""
    activation_offload: tuple[tuple[str, ...], ...] = ()
    """Fine-grained activation offloading's --offload-modules sets searched (an empty set: the
    settings of `ddp` as given), each in candidates without full recompute (whose layers save
    only their inputs). Empty: the planner's choice (plan.offload_space.activation_sets: on the
    GPU kernel set with Transformer Engine, unless the command line turned it on or
    --no-activation-offload is given), else as given."""

    fsdp: tuple[bool, ...] = ()
    """Whether throughput tries each candidate's Megatron-FSDP ZeRO-3 twin (search._with_fsdp);
    empty: the planner's choice (offload_space.searched_fsdp)."""

    @property
    def keeps_recompute(self) -> bool:
        """Whether full recompute's method and counts were given (and are kept as given)."""
        return bool(self.recompute_layers)

    def full_recompute(self, pp: int) -> Recompute:
        """The full-recompute setting of a candidate with `pp` stages."""
        if not self.recompute_layers:
            return Recompute("full", "block", (1,) * pp)
        counts = self.recompute_layers
        return Recompute(
            "full", self.recompute_method or "block", counts if len(counts) == pp else counts * pp
        )


def space_from(flags: ParallelFlags, ddp: DdpOptions = DEFAULT_DDP) -> Space:
    """The search space with the values the command line fixed (the expert TP kept as given)
    and the gradient / optimizer-state settings (the precision-aware optimizer and several
    optimizer instances fix the distributed optimizer, which megatron-core needs for them)."""
    refuse_dropped_recompute(flags)
    fixed: dict[str, Any] = {}
    if flags.expert_tensor_parallel_size:
        fixed["etp"] = flags.expert_tensor_parallel_size
    if flags.tensor_model_parallel_size:
        fixed["tp"] = (flags.tensor_model_parallel_size,)
    if flags.pipeline_model_parallel_size:
        fixed["pp"] = (flags.pipeline_model_parallel_size,)
    if flags.micro_batch_size:
        fixed["micro_batch_size"] = (flags.micro_batch_size,)
    if flags.recompute_granularity or flags.recompute_activations or flags.moe_layer_recompute:
        fixed["recompute"] = (granularity_of(flags),)
    fixed["recompute_modules"] = given_modules(flags)
    if flags.recompute_granularity == "full":
        per_stage = flags.recompute_num_layers_per_stage
        if per_stage:
            fixed["recompute_layers"] = tuple(int(x) for x in per_stage.split(","))
        elif flags.recompute_num_layers is not None:
            fixed["recompute_layers"] = (flags.recompute_num_layers,)
        fixed["recompute_method"] = flags.recompute_method or ""
    if flags.sequence_parallel:
        fixed["sequence_parallel"] = (True,)
    fixed.update(_fixed_sizes(flags))
    fixed.update(fixed_optimizer(flags, ddp))
    offload = fixed_offload(ddp)
    return replace(
        Space(), cp_comm_type=flags.cp_comm_type or "", ddp=ddp, optimizer_offload=offload, **fixed
    )


def _fixed_sizes(flags: ParallelFlags) -> dict[str, Any]:
    """The CP, EP and VPP sizes the command line fixed (VPP in either of Megatron-LM's
    spellings)."""
    fixed: dict[str, Any] = {}
    refuse_both_vpp(flags)
    if flags.num_virtual_stages_per_pipeline_rank:
        fixed["vpp"] = (flags.num_virtual_stages_per_pipeline_rank,)
    if flags.num_layers_per_virtual_pipeline_stage:
        fixed["layers_per_virtual_stage"] = flags.num_layers_per_virtual_pipeline_stage
    if flags.context_parallel_size:
        fixed["cp"] = (flags.context_parallel_size,)
    if flags.expert_model_parallel_size:
        fixed["ep"] = (flags.expert_model_parallel_size,)
    return fixed


CP_FROM = 8192
"""Sequence length from which context parallelism is searched by default on GPUs: NVIDIA's H100
recipes run CP 2 at 8192 tokens (Llama 3.1 8B / 70B / 405B, dgxc-benchmarking) and none below;
shorter sequences are planned at CP 1 unless --context-parallel-size is given."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_sizes(shape: ModelShape, cluster: Cluster, tp: int, space: Space) -> tuple[int, ...]:
    """The context-parallel sizes of a TP size: those given, else (space.cp empty) every size
    dividing the GPUs over TP when the sequence is long enough (CP_FROM) on GPUs, else 1."""
    if space.cp:
        return space.cp
    if cluster.device == "cpu" or shape.seq_length < CP_FROM or cluster.gpus % tp:
        return (1,)
    return tuple(c for c in _divisors(cluster.gpus // tp) if shape.seq_length % (2 * c) == 0)


def vpp_sizes(shape: ModelShape, pp: int, m: int, space: Space) -> tuple[int, ...]:
    """The virtual-stage counts of PP `pp` with m micro-batches: those given, else every count
    with at least one layer per virtual stage on average; interleaving (VPP > 1) needs PP > 1 and
    a multiple of PP micro-batches (Megatron's interleaved schedule)."""
    per = space.layers_per_virtual_stage
    if per:  # Megatron-LM: VPP = layers per pipeline stage / layers per virtual stage
        v = shape.num_layers // pp // per
        divides = shape.num_layers % pp == 0 and (shape.num_layers // pp) % per == 0
        return (v,) if divides and (v == 1 or (pp > 1 and m % pp == 0)) else ()
    allowed = space.vpp or tuple(range(1, shape.num_layers // pp + 1))
    return tuple(
        v for v in allowed if v == 1 or (pp > 1 and pp * v <= shape.num_layers and m % pp == 0)
    )


def virtual_stage_problem(shape: ModelShape, gpus: int, space: Space) -> str:
    """Why no pipeline size of the space splits the layers into virtual stages of
    --num-layers-per-virtual-pipeline-stage layers ('' when one does), in train's words."""
    per = space.layers_per_virtual_stage
    if not per:
        return ""
    sizes = space.pp or tuple(_divisors(gpus))
    n = shape.num_layers
    if any(n % (pp * per) == 0 for pp in sizes):
        return ""
    which = (
        f"pipeline size {sizes[0]}"
        if len(sizes) == 1
        else f"any pipeline size of {gpus} GPUs ({', '.join(map(str, sizes))})"
    )
    return (
        f"--num-layers {n} is not a multiple of {which} x "
        f"--num-layers-per-virtual-pipeline-stage {per}"
    )


def micro_batch_sizes(gbs: int, dp: int, space: Space) -> tuple[int, ...]:
    """The micro-batch sizes of DP `dp`: those given, else every power of two dividing the global
    batch over DP (NVIDIA's recipes run 1, 2 and 4); only those dividing it either way."""
    if gbs % dp:
        return ()
    allowed = space.micro_batch_size or tuple(b for b in _divisors(gbs // dp) if b & (b - 1) == 0)
    return tuple(b for b in allowed if gbs % (b * dp) == 0)


def candidates(
    shape: ModelShape, cluster: Cluster, gbs: int, space: Space
) -> Iterator[ParallelPlan]:
    """Every plan of the space that Megatron can run on exactly cluster.gpus processes."""
    for tp in space.tp:
        if tp > cluster.gpus_per_node or cluster.gpus % tp:
            continue
        for cp in cp_sizes(shape, cluster, tp, space):
            if cluster.gpus % (tp * cp) or (cp > 1 and shape.seq_length % (2 * cp)):
                continue
            for pp in space.pp or tuple(_divisors(cluster.gpus // (tp * cp))):
                if cluster.gpus % (tp * cp * pp) or pp > shape.num_layers:
                    continue
                dp = cluster.gpus // (tp * cp * pp)
                yield from _variants(shape, (tp, cp, pp, dp), gbs, space)


def expert_sizes(shape: ModelShape, tp: int, dp: int, space: Space) -> list[int]:
    """The EP sizes of a (TP, DP) candidate: those of the space that divide the experts and the
    TP x DP ranks of a stage over the expert TP (the space's, else the TP; with CP, `dp` counts
    DP x CP), expert TP x EP > 1
    for the flex dispatcher (megatron-core asserts it) and one of DeepEP's groups for its deepep
    backend (features.dispatch.DEEPEP_GROUPS); [1] for a dense model."""
    if not shape.moe.enabled:
        return [1]
    experts, etp = shape.moe.num_experts, space.etp or tp
    allowed = space.ep or tuple(_divisors(experts))
    flex = shape.moe.moe_token_dispatcher_type == "flex"  # needs expert TP x EP > 1
    deepep = flex and shape.moe.moe_flex_dispatcher_backend == "deepep"
    return [
        e
        for e in allowed
        if experts % e == 0
        and (tp * dp) % (e * etp) == 0
        and not (flex and e * etp == 1)
        and not (deepep and e * etp not in DEEPEP_GROUPS)
    ]


def _skipped_sp(shape: ModelShape, tp: int, sp: bool, space: Space) -> bool:
    """Whether a sequence-parallel setting is skipped: TP cannot split the model with it, it is
    dominated, or MoE layers with TP > 1 lack it (megatron-core trains MoE + TP only with SP)."""
    moe_without = shape.moe.enabled and tp > 1 and not sp
    return not tp_fits(shape, tp, sp) or _dominated(sp, tp, space.sequence_parallel) or moe_without


def _dominated(on: bool, size: int, allowed: tuple[bool, ...]) -> bool:
    """Sequence parallelism (TP > 1) and the distributed optimizer (DP > 1) move the same bytes as
    their absence (reduce-scatter + all-gather instead of all-reduce) and only lower memory, so when
    the space allows both, the plan without them is dominated and not searched."""
    return not on and size > 1 and True in allowed


def _allowed_ep(
    shape: ModelShape, sizes: tuple[int, int, int, int], vpp: int, base: ParallelPlan, space: Space
) -> list[int]:
    """The expert-parallel sizes of (TP, CP, PP, DP) `sizes` with which megatron-core takes the
    candidate's gradient / optimizer-state settings."""
    tp, cp, pp, dp = sizes
    do = base.distributed_optimizer
    return [
        ep
        for ep in expert_sizes(shape, tp, dp * cp, space)
        if not base.ddp.plan_problems(pp, vpp, dp * cp, dp * cp // ep, do)
        and not (space.ddp.overlap_moe_expert_parallel_comm and ep == 1)
    ]


def _variants(
    shape: ModelShape, sizes: tuple[int, int, int, int], gbs: int, space: Space
) -> Iterator[ParallelPlan]:
    """The candidates of (TP, CP, PP, DP) `sizes`."""
    _, _, pp, dp = sizes
    for mbs in micro_batch_sizes(gbs, dp, space):
        for vpp in vpp_sizes(shape, pp, gbs // (mbs * dp), space):
            if space.ddp.overlap_moe_expert_parallel_comm and pp > 1 and vpp == 1:
                continue  # megatron-core needs virtual stages for the EP overlap at PP > 1
            yield from _settings(shape, sizes, vpp, mbs, gbs, space)


def _settings(
    shape: ModelShape, sizes: tuple[int, int, int, int], vpp: int, mbs: int, gbs: int, space: Space
) -> Iterator[ParallelPlan]:
    """The candidates of (TP, CP, PP, DP) `sizes` with `vpp` virtual stages and micro-batch
    `mbs`: sequence parallelism, recompute, the distributed optimizer, EP."""
    tp, cp, pp, dp = sizes
    for sp in space.sequence_parallel:
        if sp and tp == 1:  # Megatron-LM turns sequence parallelism off at TP 1
            if False in space.sequence_parallel:
                continue
            sp = False
        if _skipped_sp(shape, tp, sp, space):
            continue
        for rc in space.recompute:
            if rc == "full" and space.ddp.overlap_moe_expert_parallel_comm:
                continue  # megatron-core refuses full recompute with the EP overlap
            recompute = space.full_recompute(pp) if rc == "full" else Recompute(rc)
            if rc == "selective":
                recompute = Recompute.selective(space.recompute_modules)
            for do, ddp in _offload_settings(dp * cp, rc, space):
                base = ParallelPlan(
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    cp=cp,
                    cp_comm_type=space.cp_comm_type if cp > 1 else "",
                    vpp=vpp,
                    micro_batch_size=mbs,
                    global_batch_size=gbs,
                    layers_per_stage=_even(shape.num_layers, pp * vpp),
                    recompute=recompute,
                    sequence_parallel=sp,
                    distributed_optimizer=do,
                    ddp=ddp,
                    mtp_layers=shape.mtp_num_layers,
                )
                yield from _expert_plans(shape, base, space)


def optimizer_settings(dp_cp: int, space: Space) -> list[tuple[bool, DdpOptions]]:
    """(distributed optimizer, settings) of a candidate with `dp_cp` data x context-parallel
    ranks: the distributed optimizer where not dominated (_dominated; at DP 1 only when fixed), and
    each offload fraction > 0 with the distributed optimizer (which the precision-aware optimizer
    needs, DP 1 included)."""
    out = []
    allowed = space.distributed_optimizer
    for do in allowed:
        plain = not ((do and dp_cp == 1 and len(allowed) > 1) or _dominated(do, dp_cp, allowed))
        for fraction in space.optimizer_offload or (0.0,):
            ddp = offload_ddp(space.ddp, fraction)
            if do if ddp.optimizer_cpu_offload else plain:
                out.append((do, ddp))
    return out


def _offload_settings(dp_cp: int, rc: str, space: Space) -> list[tuple[bool, DdpOptions]]:
    """optimizer_settings, each with every activation offload set of the space (none with full
    recompute `rc`)."""
    sets = space.activation_offload or ((),)
    return [
        (do, activation_ddp(ddp, modules))
        for do, ddp in optimizer_settings(dp_cp, space)
        for modules in sets
        if not (modules and rc == "full")
    ]


def _even(layers: int, stages: int) -> tuple[int, ...]:
    """Megatron's even split of `layers` over `stages` (the earlier stages take the remainder)."""
    return tuple(layers // stages + (1 if i < layers % stages else 0) for i in range(stages))


def _expert_plans(shape: ModelShape, base: ParallelPlan, space: Space) -> Iterator[ParallelPlan]:
    """`base` at each expert-parallel size megatron-core takes with the space's gradient /
    optimizer-state settings, less the plans whose multi-token prediction layers are not
    modelled (CP > 1, uniform recompute: config.parallel.mtp_problems)."""
    sizes = (base.tp, base.cp, base.pp, base.dp)
    for ep in _allowed_ep(shape, sizes, base.vpp, base, space):
        etp = space.etp if space.etp not in (0, base.tp) and shape.moe.enabled else 0
        plan = replace(base, ep=ep, etp=etp)
        if not mtp_problems(shape, plan):
            yield plan


def overlap_space(space: Space, kernels: Kernels) -> Space:
    """The space with --tp-comm-overlap's constraint (Megatron-LM needs sequence parallelism,
    which it turns off at TP 1): TP > 1 with sequence parallelism; CaptureError when the given
    sizes leave none. Unchanged without the flag."""
    if not kernels.tp_comm_overlap:
        return space
    tps = tuple(t for t in space.tp if t > 1)
    if not tps or space.sequence_parallel == (False,):
        raise CaptureError(tp_overlap_problem("gpu", kernels, 1, False) + ".")
    return replace(space, tp=tps, sequence_parallel=(True,))
