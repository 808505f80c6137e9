"""Emit: a plan as Megatron flags, and a model as Megatron flags (pure Python).

`model_args(shape) + plan_args(plan)` given to `pretrain_gpt` (ours or Megatron-LM's) runs exactly
the plan that was predicted; parsing them back (capture_megatron.flags.args) gives the same
objects."""

from __future__ import annotations

import dataclasses

from capture_megatron.config import Kernels, ModelShape, ParallelFlags, ParallelPlan
from capture_megatron.fields import to_flags
from capture_megatron.steptime.settings import StepSettings


def overlap_args(plan: ParallelPlan, settings: StepSettings) -> list[str]:
    """The data-parallel overlap flags of a run (`settings`) that apply to the plan: gradient
    reduce with DP x CP > 1, parameter gather also with the distributed optimizer (Megatron-LM
    runs it only there); --overlap-grad-reduce not twice when the plan's DdpOptions has it."""
    if plan.dp * plan.cp == 1 or plan.ddp.optimizer.muon:  # Megatron-LM asserts Muon without
        return []
    grad = settings.overlap_grad_reduce and not plan.ddp.overlap_grad_reduce
    out = ["--overlap-grad-reduce"] if grad else []
    if settings.overlap_param_gather and plan.distributed_optimizer:
        out.append("--overlap-param-gather")
    return out


def run_args(
    plan: ParallelPlan,
    kernels: Kernels,
    gpu_kernels: bool,
    settings: StepSettings | None = None,
    recompute_modules: tuple[str, ...] = (),
) -> list[str]:
    """A plan JSON's `megatron_args`: the plan's flags, the data-parallel overlap flags of a GPU
    run (`settings`; None for CPU processes), the kernel set the forecast assumed (`gpu_kernels`:
    a GPU kernel set), and the searched --recompute-modules when the plan does not name them."""
    given = plan_args(plan)
    if recompute_modules and "--recompute-modules" not in given:
        given += ["--recompute-modules", *recompute_modules]
    overlap = overlap_args(plan, settings) if settings is not None else []
    return given + overlap + kernel_args(kernels, gpu_kernels)


def plan_args(plan: ParallelPlan) -> list[str]:
    """Every parallel, batch and recompute setting of the plan in Megatron's flag names (written
    from the fields' flags: `parallel_flags`), then its gradient-buffer, offload, optimizer and
    Megatron-FSDP options (with the checkpoint format Megatron-LM requires of Megatron-FSDP)."""
    offload = to_flags(plan.ddp.activation_offload)  # fine-grained activation offloading
    ddp = to_flags(plan.ddp) + offload + to_flags(plan.ddp.optimizer) + to_flags(plan.ddp.fsdp)
    ckpt = ["--ckpt-format", "fsdp_dtensor"] if plan.ddp.fsdp.enabled else []  # Megatron-LM's
    return to_flags(parallel_flags(plan)) + ddp + ckpt + to_flags(plan.ddp.cuda_graphs)


def parallel_flags(plan: ParallelPlan) -> ParallelFlags:
    """The plan as the command line that runs it gives it (what `capture_megatron.flags.resolve`
    reads back into the same plan): Megatron's defaults left out (PP 1 has no layout, CP and EP 1
    no size), the partition as --pipeline-model-parallel-layout, recompute as `recompute_flags`."""
    return dataclasses.replace(
        recompute_flags(plan),
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        micro_batch_size=plan.micro_batch_size,
        global_batch_size=plan.global_batch_size,
        pipeline_model_parallel_layout=plan.layout if plan.pp > 1 else None,
        microbatch_group_size_per_vp_stage=plan.microbatch_group_size or None,
        context_parallel_size=plan.cp if plan.cp > 1 else None,
        cp_comm_type=plan.cp_comm_type or None,
        expert_model_parallel_size=plan.ep if plan.ep > 1 else None,
        expert_tensor_parallel_size=plan.etp or None,
        sequence_parallel=plan.sequence_parallel or None,
        use_distributed_optimizer=plan.distributed_optimizer or None,
    )


def recompute_flags(plan: ParallelPlan) -> ParallelFlags:
    """The plan's recompute as ParallelFlags (--recompute-modules as given: megatron-core reads
    them for selective recompute only); a single --recompute-num-layers where one count
    recomputes what the per-stage counts do (`stock_recompute_count`)."""
    rc = plan.recompute
    modules = rc.modules or None
    if rc.granularity != "full":
        selective = "selective" if rc.granularity == "selective" else None
        return ParallelFlags(recompute_granularity=selective, recompute_modules=modules)
    n = stock_recompute_count(plan)
    per_stage = None if n is not None else ",".join(str(k) for k in rc.num_layers)
    return ParallelFlags(
        recompute_granularity="full",
        recompute_method=rc.method,
        recompute_num_layers=n,
        recompute_num_layers_per_stage=per_stage,
        recompute_modules=modules,
    )


def stock_recompute_count(plan: ParallelPlan) -> int | None:
    """The one --recompute-num-layers that recomputes what the plan's per-stage counts do, or None
    when no single count does (then only capture-megatron's per-stage flag expresses the plan).

    Megatron's block method recomputes the first min(n, k) layers of each chunk of k layers, so a
    stage whose count covers all its layers agrees with any count at least its largest chunk; a
    stage recomputing fewer than its largest chunk needs exactly its own count."""
    rc = plan.recompute
    if rc.granularity != "full":
        return None
    largest = [max(plan.chunks_of(r)) for r in range(plan.pp)]
    exact = {n for n, k in zip(rc.num_layers, largest) if n < k}
    if len(exact) > 1:
        return None
    n = exact.pop() if exact else max(rc.num_layers)
    covered = all(m == n or (m >= k and n >= k) for m, k in zip(rc.num_layers, largest))
    return n if covered else None


def model_args(shape: ModelShape) -> list[str]:
    """The model's architecture in Megatron's flag names."""
    out = [
        "--num-layers",
        str(shape.num_layers),
        "--hidden-size",
        str(shape.hidden_size),
        "--num-attention-heads",
        str(shape.num_attention_heads),
        "--seq-length",
        str(shape.seq_length),
        "--max-position-embeddings",
        str(shape.max_positions),
        "--vocab-size",
        str(shape.vocab_size),
    ]
    if shape.ffn_hidden_size:
        out += ["--ffn-hidden-size", str(shape.ffn_hidden_size)]
    if shape.num_query_groups and shape.num_query_groups != shape.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    if shape.kv_channels:
        out += ["--kv-channels", str(shape.kv_channels)]
    if shape.make_vocab_size_divisible_by != 128:
        out += ["--make-vocab-size-divisible-by", str(shape.make_vocab_size_divisible_by)]
    if shape.swiglu:
        out.append("--swiglu")
    if shape.normalization != "LayerNorm":
        out += ["--normalization", shape.normalization]
    if shape.untie_embeddings_and_output_weights:
        out.append("--untie-embeddings-and-output-weights")
    if shape.position_embedding_type != "learned_absolute":
        out += ["--position-embedding-type", shape.position_embedding_type]
    if not shape.add_bias_linear:
        out.append("--disable-bias-linear")
    out += feature_args(shape) + to_flags(shape.moe)
    out += [
        "--hidden-dropout",
        repr(shape.hidden_dropout),
        "--attention-dropout",
        repr(shape.attention_dropout),
    ]
    if shape.dtype == "bf16":
        out.append("--bf16")
    elif shape.dtype == "fp16":
        out.append("--fp16")
    return out


def feature_args(shape: ModelShape) -> list[str]:
    """The architecture flags beyond the sizes that differ from Megatron-LM's defaults: GeGLU,
    QKV biases, norm epsilon, RoPE base and scaling, sliding window, query/key norms,
    multi-latent attention, multi-token prediction."""
    out = ["--geglu"] if shape.geglu else []
    if shape.add_qkv_bias:
        out.append("--add-qkv-bias")
    if shape.norm_epsilon != 1e-5:
        out += ["--norm-epsilon", repr(shape.norm_epsilon)]
    if shape.rotary_base != 10000:
        out += ["--rotary-base", str(shape.rotary_base)]
    if shape.use_rope_scaling:
        out.append("--use-rope-scaling")
    if shape.use_rope_scaling or shape.rope_scaling_factor != 8.0:
        out += ["--rope-scaling-factor", repr(shape.rope_scaling_factor)]
    if shape.window_size:
        out += ["--window-size", ",".join(map(str, shape.window_size))]
    out += ["--qk-layernorm"] if shape.qk_layernorm else []
    out += ["--qk-l2-norm"] if shape.qk_l2_norm else []
    out += to_flags(shape.mla) if shape.mla.enabled else []
    out += ["--mtp-num-layers", str(shape.mtp_num_layers)] if shape.mtp_num_layers else []
    return out


GEGLU_NOTE = (
    "--geglu (GeGLU: the gated tanh-GELU MLP) is capture-megatron's flag: stock Megatron-LM's "
    "pretrain_gpt.py cannot build this model (it has --swiglu, and --quick-geglu, which is "
    "x * sigmoid(1.702 x), a different activation); capture-megatron's own pretrain_gpt "
    "(capture-megatron train / verify / launch) builds it"
)
"""What model_notes says of a GeGLU model."""


def model_notes(shape: ModelShape) -> tuple[str, ...]:
    """What the emitted model flags cannot do in stock Megatron-LM (core_v0.16.1), and where the
    model's parts sit (MTP, MoE routing), for the CLI to print with them."""
    notes = [GEGLU_NOTE] if shape.geglu else []
    if shape.use_rope_scaling and shape.rope_scaling_factor != 8.0:
        notes.append(
            f"--rope-scaling-factor {shape.rope_scaling_factor:g}: stock Megatron-LM's "
            "pretrain_gpt.py (gpt_builders.py) passes --use-rope-scaling but not the factor to "
            "GPTModel, so it builds factor 8; capture-megatron's pretrain_gpt uses the factor "
            "(either way the memory is the same)"
        )
    if shape.mtp_num_layers:
        notes.append(
            f"multi-token prediction: its {shape.mtp_num_layers} layer(s) sit on the last "
            "pipeline stage with a copy of the embedding, and megatron-core recomputes them only "
            "under --recompute-method uniform (not modelled), never under block"
        )
    return tuple(notes) + routing_notes(shape)


def routing_notes(shape: ModelShape) -> tuple[str, ...]:
    """Which token counts the forecast of capacity-bounded MoE layers allows for (empty for a
    dense model and for dropless routing, whose factors depend on the plan: PlanResult.routing
    says them)."""
    moe = shape.moe
    if not moe.enabled or moe.dropless:
        return ()
    padded = moe.moe_pad_expert_input_to_capacity
    return (
        f"MoE routing: capacity factor {moe.moe_expert_capacity_factor:g}"
        + (
            ", padded: the expert bytes are exact"
            if padded
            else "; the forecast pads every expert to its capacity (a bound)"
        ),
    )


def resolved_impl(kernels: Kernels, gpu: bool = True) -> str:
    """The layer implementation as Megatron-LM names it: `auto` is what capture-megatron's
    training picks for it (Transformer Engine on a GPU, the local spec on CPU)."""
    if kernels.transformer_impl != "auto":
        return kernels.transformer_impl
    return "transformer_engine" if gpu else "local"


def kernel_args(kernels: Kernels, gpu: bool = True) -> list[str]:
    """The layer implementation and attention backend, always named (the kernel set the forecast
    assumed), and every other kernel setting that differs from Megatron-LM's default, in
    Megatron-LM's own flags: `auto` is named as the implementation it picks (resolved_impl; `gpu`:
    a GPU kernel set), and the cuBLAS workspace is an environment variable (see flag_notes). The
    CPU kernel set (`gpu` False) is the local spec with torch's CPU kernels, all fusions off (what
    `train` runs on CPU, whatever kernel flags it is given): `--transformer-impl local`."""
    if not gpu:  # the CPU kernel set: the local spec, every fusion off whatever the flags say
        return ["--transformer-impl", "local"]
    named = ["--transformer-impl", resolved_impl(kernels, gpu)]
    named += ["--attention-backend", kernels.attention_backend]
    rest = to_flags(kernels)
    for flag in ("--transformer-impl", "--attention-backend", "--cublas-workspace-config"):
        if flag in rest:
            at = rest.index(flag)
            del rest[at : at + 2]
    return named + rest


PER_STAGE_NOTE = (
    "these flags need capture-megatron's per-stage recompute (its pretrain_gpt, or the "
    "`capture-megatron megatron-lm` wrapper / patch: patches/README.md); stock Megatron-LM rejects "
    "--recompute-num-layers-per-stage"
)
"""What a plan whose flags hold --recompute-num-layers-per-stage says next to them."""


ADAM_ASSUMED = {
    "fused": "Transformer Engine's or apex's FusedAdam",
    "torch": "torch.optim.AdamW: neither Transformer Engine nor apex installed",
}
"""What a GPU forecast assumes for each --adam-impl given."""


def flag_notes(plan: ParallelPlan, kernels: Kernels, gpu: bool = True) -> tuple[str, ...]:
    """What running the plan's megatron_args needs beyond stock Megatron-LM (empty: nothing;
    `gpu`: a GPU kernel set)."""
    notes = []
    if "--recompute-num-layers-per-stage" in plan_args(plan):
        notes.append(PER_STAGE_NOTE)
    if kernels.transformer_impl == "auto" and gpu:
        notes.append(
            f"--transformer-impl auto is written as {resolved_impl(kernels, gpu)}, what auto "
            f"picks {'on a GPU' if gpu else 'on CPU'} (Megatron-LM has no auto)"
        )
    if kernels.adam_impl != "auto" and gpu:
        assumed = ADAM_ASSUMED[kernels.adam_impl]
        notes.append(
            f"--adam-impl {kernels.adam_impl} is capture-megatron's (the forecast assumes "
            f"{assumed}); stock Megatron-LM has no such flag and trains with whichever Adam is "
            "installed: leave it out there"
        )
    if kernels.cublas_workspace_config and gpu:
        notes.append(
            f"set CUBLAS_WORKSPACE_CONFIG={kernels.cublas_workspace_config} in the training "
            "environment (the forecast assumes it; it is not a Megatron-LM flag)"
        )
    return tuple(notes)
