"""ParallelFlags -> ParallelPlan, resolved exactly as Megatron would for a run of N processes.

An explicit --pipeline-model-parallel-layout wins; else --decoder-first/last-pipeline-num-layers;
else the uniform split (with --num-layers-per-virtual-pipeline-stage or
--num-virtual-stages-per-pipeline-rank for VPP). Unset sizes default to 1, like Megatron's.
Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses

from capture_megatron.config.ddp import DEFAULT_DDP, DdpOptions
from capture_megatron.config.layout import accounted_split, first_last_split, parse_layout
from capture_megatron.config.model import ModelShape, tp_head_problems
from capture_megatron.config.parallel import ParallelFlags, ParallelPlan, Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.rules.megatron import check_plan_fits_model


def recompute(flags: ParallelFlags, pp: int) -> Recompute:
    """Recompute setting from --recompute-* flags (per-stage counts via our per-stage flag;
    --recompute-modules and the deprecated --moe-layer-recompute as megatron-core reads them)."""
    granularity = granularity_of(flags)
    modules = given_modules(flags)
    per_stage = flags.recompute_num_layers_per_stage
    if per_stage:
        try:
            counts = tuple(int(x) for x in per_stage.split(","))
        except ValueError:
            raise CaptureError(
                f"--recompute-num-layers-per-stage {per_stage!r}: expected integers like 2,1,0,0"
            ) from None
        if len(counts) != pp:
            raise CaptureError(
                f"--recompute-num-layers-per-stage {per_stage!r} has {len(counts)} entries "
                f"for pipeline size {pp}"
            )
        if granularity not in ("none", "full") or (flags.recompute_method or "block") != "block":
            raise CaptureError(
                "--recompute-num-layers-per-stage needs --recompute-granularity full "
                "--recompute-method block"
            )
        return Recompute("full", "block", counts, modules)
    if granularity == "full":
        if flags.recompute_method is None or flags.recompute_num_layers is None:
            raise CaptureError(
                "--recompute-granularity full needs --recompute-method and --recompute-num-layers"
            )
        counts = (flags.recompute_num_layers,) * pp
        return Recompute("full", flags.recompute_method, counts, modules)
    if flags.recompute_num_layers is not None:
        raise CaptureError(
            f"--recompute-num-layers {flags.recompute_num_layers} needs "
            "--recompute-granularity full"
        )
    return Recompute(granularity, modules=modules)


def granularity_of(flags: ParallelFlags) -> str:
    """The recompute granularity the flags give: --recompute-granularity, else selective with
    --recompute-activations or the deprecated --moe-layer-recompute (megatron-core 0.16.1 makes
    the granularity selective for it, and refuses it with full recompute), else none."""
    moe_layer = bool(flags.moe_layer_recompute)
    if moe_layer and flags.recompute_granularity == "full":
        raise CaptureError(
            "--moe-layer-recompute with --recompute-granularity full: megatron-core 0.16.1's "
            "TransformerConfig refuses it ('Do not set --moe-layer-recompute with full recompute "
            "granularity'); the deprecated flag means selective recompute with 'moe' added to "
            "--recompute-modules: leave one of them out."
        )
    if flags.recompute_granularity:
        return flags.recompute_granularity
    return "selective" if flags.recompute_activations or moe_layer else "none"


def given_modules(flags: ParallelFlags) -> tuple[str, ...]:
    """--recompute-modules as given (empty: not given, megatron-core's default core_attn), with
    'moe' added by the deprecated --moe-layer-recompute as megatron-core 0.16.1 adds it (to the
    default core_attn when no modules are given)."""
    modules = tuple(flags.recompute_modules or ())
    if flags.moe_layer_recompute and "moe" not in modules:
        return (*(modules or ("core_attn",)), "moe")
    return modules


def _split(
    flags: ParallelFlags, num_layers: int, pp: int, mtp_layers: int = 0
) -> tuple[tuple[int, ...], int]:
    """(layers per virtual stage, vpp) from the layout / first-last / VPP flags."""
    if flags.pipeline_model_parallel_layout:
        clash = [
            f
            for f in (
                "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers",
                "num_layers_per_virtual_pipeline_stage",
                "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split",
            )
            if getattr(flags, f)
        ]
        if clash:
            raise CaptureError(
                "--pipeline-model-parallel-layout cannot be combined with "
                + ", ".join("--" + f.replace("_", "-") for f in clash)
            )
        counts = parse_layout(flags.pipeline_model_parallel_layout, pp, num_layers, mtp_layers)
        vpp = len(counts) // pp
        given = flags.num_virtual_stages_per_pipeline_rank
        if given is not None and given != vpp:
            raise CaptureError(
                f"--num-virtual-stages-per-pipeline-rank {given} conflicts with "
                f"--pipeline-model-parallel-layout, which has {len(counts)} stages, {vpp} per "
                f"pipeline rank (megatron-core's TransformerConfig: "
                "'virtual_pipeline_model_parallel_size conflicts with "
                "pipeline_model_parallel_layout'); give one of them, or the layout's count"
            )
        return counts, vpp
    embedding = bool(flags.account_for_embedding_in_pipeline_split)
    loss = bool(flags.account_for_loss_in_pipeline_split)
    vpp = _vpp(flags, num_layers + int(embedding) + int(loss), pp)
    first, last = flags.decoder_first_pipeline_num_layers, flags.decoder_last_pipeline_num_layers
    if (embedding or loss) and (first is not None or last is not None):
        raise CaptureError(
            "--decoder-first/last-pipeline-num-layers cannot be combined with "
            "--account-for-embedding/loss-in-pipeline-split (Megatron refuses it too)"
        )
    if embedding or loss:
        return accounted_split(num_layers, pp, vpp, embedding, loss), vpp
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise CaptureError(
                f"--num-layers {num_layers} does not split evenly over {pp} pipeline stages"
                + (f" x {vpp} virtual stages" if vpp > 1 else "")
                + "; give --pipeline-model-parallel-layout (e.g. from `capture-megatron plan`)"
            )
        return (num_layers // (pp * vpp),) * (pp * vpp), vpp
    return first_last_split(num_layers, pp, vpp, first, last), vpp


def refuse_both_vpp(flags: ParallelFlags) -> None:
    """CaptureError when both spellings of VPP are given (Megatron-LM asserts the same)."""
    per, count = (
        flags.num_layers_per_virtual_pipeline_stage,
        flags.num_virtual_stages_per_pipeline_rank,
    )
    if per is not None and count is not None:
        raise CaptureError(
            f"--num-layers-per-virtual-pipeline-stage {per} and "
            f"--num-virtual-stages-per-pipeline-rank {count} cannot be set at the same time "
            "(Megatron-LM refuses it too): give one of them"
        )


def split_notes(flags: ParallelFlags) -> tuple[str, ...]:
    """What the output says of the pipeline split flags: a layout given with an agreeing
    --num-virtual-stages-per-pipeline-rank (as Megatron-Bridge passes them) runs in megatron-core,
    whose TransformerConfig only checks they agree, but Megatron-LM's pretrain_gpt.py takes one of
    them (arguments.py asserts it)."""
    if not (flags.pipeline_model_parallel_layout and flags.num_virtual_stages_per_pipeline_rank):
        return ()
    return (
        "--pipeline-model-parallel-layout with --num-virtual-stages-per-pipeline-rank "
        f"{flags.num_virtual_stages_per_pipeline_rank}: megatron-core (and Megatron-Bridge, which "
        "sets both) runs them when they agree, as here; Megatron-LM's pretrain_gpt.py takes only "
        "one of them ('No more than one of the following arguments can be set at the same time'): "
        "give it the layout alone",
    )


def _vpp(flags: ParallelFlags, num_layers: int, pp: int) -> int:
    refuse_both_vpp(flags)
    if flags.num_virtual_stages_per_pipeline_rank is not None:
        return flags.num_virtual_stages_per_pipeline_rank
    per = flags.num_layers_per_virtual_pipeline_stage
    if per is None:
        return 1
    if per < 1 or num_layers % (pp * per):
        raise CaptureError(
            f"--num-layers {num_layers} is not a multiple of pipeline size {pp} x "
            f"--num-layers-per-virtual-pipeline-stage {per}"
        )
    return num_layers // (pp * per)


def refuse_dropped_recompute(flags: ParallelFlags) -> None:
    """CaptureError for recompute flags the planner could not keep as given: a method or layer
    counts without --recompute-granularity full, --recompute-method uniform without its group
    size, per-stage counts with the uniform method."""
    full = granularity_of(flags) == "full"
    given = {
        "--recompute-method": flags.recompute_method,
        "--recompute-num-layers": flags.recompute_num_layers,
        "--recompute-num-layers-per-stage": flags.recompute_num_layers_per_stage,
    }
    stray = [f"{k} {v}" for k, v in given.items() if v is not None]
    if stray and not full:
        raise CaptureError(
            f"{', '.join(stray)}: only full recompute has a method and layer counts (recompute "
            f"given: {flags.recompute_granularity or 'none'}); add --recompute-granularity full, "
            "or leave them out"
        )
    per_stage = flags.recompute_num_layers_per_stage
    if full and flags.recompute_method == "uniform" and per_stage:
        raise CaptureError(
            "--recompute-num-layers-per-stage needs --recompute-method block (uniform recomputes "
            "every layer of a stage, n at a time)"
        )
    if full and flags.recompute_method == "uniform" and flags.recompute_num_layers is None:
        raise CaptureError(
            "--recompute-method uniform needs --recompute-num-layers n (layers per recomputed "
            "group), as Megatron-LM does; or give --recompute-method block without a count to "
            "let the planner choose the layers recomputed per stage"
        )


def block_counts_held(rc: Recompute, layers_per_stage: tuple[int, ...], pp: int) -> Recompute:
    """Full block recompute with each stage's count at most its largest chunk: Megatron's block
    method recomputes min(n, k) layers of a chunk of k, so every larger n is the same run, and the
    plan names the one the planner writes (`--recompute-num-layers 4` over stages of 2 and 3 layers
    is (2, 3); emitted again, it is `--recompute-num-layers 3`, the same run)."""
    if rc.granularity != "full" or rc.method != "block":
        return rc
    largest = [max(layers_per_stage[r::pp]) for r in range(pp)]
    held = tuple(min(n, k) for n, k in zip(rc.num_layers, largest, strict=True))
    return dataclasses.replace(rc, num_layers=held)


def parallel_plan(
    flags: ParallelFlags, shape: ModelShape, world_size: int, ddp: DdpOptions = DEFAULT_DDP
) -> ParallelPlan:
    """ParallelPlan of a training run on `world_size` processes (unset sizes default to 1) with
    the gradient / optimizer-state settings `ddp`."""
    tp = flags.tensor_model_parallel_size or 1
    pp = flags.pipeline_model_parallel_size or 1
    cp = flags.context_parallel_size or 1
    problems = []
    if tp_head_problems(shape.num_attention_heads, shape.groups, tp):
        problems.append(
            f"heads {shape.num_attention_heads} (query groups {shape.groups}) not divisible by "
            f"TP {tp}"
        )
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
        problems.append(
            f"world size {world_size} is not divisible by TP {tp} x PP {pp}"
            + (f" x CP {cp}" if cp > 1 else "")
            + f"; use a multiple of {max(tp, 1) * max(pp, 1) * cp} processes"
        )
    if problems:
        raise CaptureError("; ".join(problems))
    dp = world_size // (tp * pp * cp)
    mbs = flags.micro_batch_size or 1
    gbs = flags.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise CaptureError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x DP {dp}; "
            f"use a multiple of {mbs * dp}"
        )
    counts, vpp = _split(flags, shape.num_layers, pp, shape.mtp_num_layers)
    plan = ParallelPlan(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        vpp=vpp,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        layers_per_stage=counts,
        recompute=block_counts_held(recompute(flags, pp), counts, pp),
        sequence_parallel=bool(flags.sequence_parallel) and tp > 1,  # as Megatron-LM: off at TP 1
        distributed_optimizer=bool(flags.use_distributed_optimizer),
        microbatch_group_size=flags.microbatch_group_size_per_vp_stage or 0,
        ep=flags.expert_model_parallel_size or 1,
        etp=flags.expert_tensor_parallel_size or 0,
        cp_comm_type=flags.cp_comm_type or "",
        mtp_layers=shape.mtp_num_layers,
        ddp=ddp,
    )
    check_plan_fits_model(shape, plan)
    return plan
