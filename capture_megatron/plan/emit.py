"""Emit: a plan as Megatron flags, and a model as Megatron flags (pure Python).

`model_args(shape) + plan_args(plan)` given to `pretrain_gpt` (ours or Megatron-LM's) runs exactly
the plan that was predicted; parsing them back (capture_megatron.megatron.args) gives the same
objects."""

from __future__ import annotations

from capture_megatron.config import Kernels, ModelShape, ParallelPlan
from capture_megatron.config.fields import to_flags


def plan_args(plan: ParallelPlan) -> list[str]:
    """Every parallel and batch setting of the plan in Megatron's flag names."""
    out = [
        "--tensor-model-parallel-size",
        str(plan.tp),
        "--pipeline-model-parallel-size",
        str(plan.pp),
        "--micro-batch-size",
        str(plan.micro_batch_size),
        "--global-batch-size",
        str(plan.global_batch_size),
    ]
    if plan.pp > 1:
        out += ["--pipeline-model-parallel-layout", plan.layout]
    if plan.microbatch_group_size:
        out += [
            "--microbatch-group-size-per-virtual-pipeline-stage",
            str(plan.microbatch_group_size),
        ]
    if plan.cp > 1:
        out += ["--context-parallel-size", str(plan.cp)]
    if plan.sequence_parallel:
        out.append("--sequence-parallel")
    if plan.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    rc = plan.recompute
    if rc.granularity == "selective":
        out += ["--recompute-granularity", "selective"]
    elif rc.granularity == "full":
        if len(set(rc.num_layers)) == 1:
            out += [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                rc.method,
                "--recompute-num-layers",
                str(rc.num_layers[0]),
            ]
        else:
            out += [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers-per-stage",
                ",".join(str(n) for n in rc.num_layers),
            ]
    return out


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


def kernel_args(kernels: Kernels) -> list[str]:
    """The layer implementation and attention backend, always named (the kernel set the forecast
    assumed), and every other kernel setting that differs from Megatron-LM's default."""
    named = ["--transformer-impl", kernels.transformer_impl]
    named += ["--attention-backend", kernels.attention_backend]
    rest = to_flags(kernels)
    for flag in ("--transformer-impl", "--attention-backend"):
        if flag in rest:
            at = rest.index(flag)
            del rest[at : at + 2]
    return named + rest
