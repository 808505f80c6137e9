"""Parsed Megatron flags -> the typed objects between stages (ModelShape, ParallelPlan, options).

Pure Python (no torch). The parallel part resolves the pipeline split exactly as Megatron would:
an explicit --pipeline-model-parallel-layout wins; else --decoder-first/last-pipeline-num-layers;
else the uniform split (with --num-layers-per-virtual-pipeline-stage or
--num-virtual-stages-per-pipeline-rank for VPP).
"""
from __future__ import annotations

import argparse

from capture_megatron.config import ModelShape, ParallelPlan, Recompute, check_plan_fits_model
from capture_megatron.errors import CaptureError, require
from capture_megatron.layout import parse_layout
from capture_megatron.megatron.builder_options import BuildOptions
from capture_megatron.train.options import CheckpointOptions, DataOptions, OptimOptions, RunOptions


def model_shape(ns: argparse.Namespace, vocab_size: int | None = None) -> ModelShape:
    """ModelShape from model flags; `vocab_size` (the tokenizer's) fills in a missing --vocab-size."""
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
               if getattr(ns, f) is None]
    vocab = ns.vocab_size if ns.vocab_size is not None else vocab_size
    if vocab is None:
        missing.append("vocab_size")
    require([f"--{f.replace('_', '-')} is required" for f in missing], "model flags")
    if vocab_size is not None and ns.vocab_size is not None and ns.vocab_size < vocab_size:
        raise CaptureError(f"--vocab-size {ns.vocab_size} is smaller than the tokenizer's {vocab_size}")
    if ns.bf16 and ns.fp16:
        raise CaptureError("give at most one of --bf16 and --fp16")
    if ns.num_query_groups is not None and not ns.group_query_attention:
        raise CaptureError(f"--num-query-groups {ns.num_query_groups} needs --group-query-attention")
    return ModelShape(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        seq_length=ns.seq_length, vocab_size=vocab, ffn_hidden_size=ns.ffn_hidden_size or 0,
        num_query_groups=(ns.num_query_groups or 0) if ns.group_query_attention else 0,
        kv_channels=ns.kv_channels or 0, max_position_embeddings=ns.max_position_embeddings or 0,
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by, swiglu=ns.swiglu,
        normalization=ns.normalization,
        untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights,
        position_embedding_type=ns.position_embedding_type, add_bias_linear=not ns.disable_bias_linear,
        hidden_dropout=ns.hidden_dropout, attention_dropout=ns.attention_dropout,
        dtype="bf16" if ns.bf16 else ("fp16" if ns.fp16 else "fp32"),
    )


def recompute(ns: argparse.Namespace, pp: int) -> Recompute:
    """Recompute setting from --recompute-* flags (per-stage counts via our per-stage flag)."""
    granularity = ns.recompute_granularity or ("selective" if ns.recompute_activations else "none")
    per_stage = ns.recompute_num_layers_per_stage
    if per_stage:
        try:
            counts = tuple(int(x) for x in per_stage.split(","))
        except ValueError:
            raise CaptureError(f"--recompute-num-layers-per-stage {per_stage!r}: expected integers like 2,1,0,0")
        if len(counts) != pp:
            raise CaptureError(f"--recompute-num-layers-per-stage {per_stage!r} has {len(counts)} entries "
                               f"for pipeline size {pp}")
        if granularity not in ("none", "full") or (ns.recompute_method or "block") != "block":
            raise CaptureError("--recompute-num-layers-per-stage needs --recompute-granularity full "
                               "--recompute-method block")
        return Recompute("full", "block", counts)
    if granularity == "full":
        if ns.recompute_method is None or ns.recompute_num_layers is None:
            raise CaptureError("--recompute-granularity full needs --recompute-method and --recompute-num-layers")
        return Recompute("full", ns.recompute_method, (ns.recompute_num_layers,) * pp)
    if ns.recompute_num_layers is not None:
        raise CaptureError(f"--recompute-num-layers {ns.recompute_num_layers} needs --recompute-granularity full")
    return Recompute(granularity)


def _split(ns: argparse.Namespace, num_layers: int, pp: int) -> tuple[tuple[int, ...], int]:
    """(layers per virtual stage, vpp) from the layout / first-last / VPP flags."""
    if ns.pipeline_model_parallel_layout:
        clash = [f for f in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                             "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
                 if getattr(ns, f) is not None]
        if clash:
            raise CaptureError("--pipeline-model-parallel-layout cannot be combined with "
                               + ", ".join("--" + f.replace("_", "-") for f in clash))
        counts = parse_layout(ns.pipeline_model_parallel_layout, pp, num_layers)
        return counts, len(counts) // pp
    vpp = _vpp(ns, num_layers, pp)
    first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise CaptureError(f"--num-layers {num_layers} does not split evenly over {pp} pipeline stages"
                               + (f" x {vpp} virtual stages" if vpp > 1 else "")
                               + "; give --pipeline-model-parallel-layout (e.g. from `capture-megatron plan`)")
        return (num_layers // (pp * vpp),) * (pp * vpp), vpp
    return first_last_split(num_layers, pp, vpp, first, last), vpp


def _vpp(ns: argparse.Namespace, num_layers: int, pp: int) -> int:
    if ns.num_virtual_stages_per_pipeline_rank is not None:
        return ns.num_virtual_stages_per_pipeline_rank
    per = ns.num_layers_per_virtual_pipeline_stage
    if per is None:
        return 1
    if per < 1 or num_layers % (pp * per):
        raise CaptureError(f"--num-layers {num_layers} is not a multiple of pipeline size {pp} x "
                           f"--num-layers-per-virtual-pipeline-stage {per}")
    return num_layers // (pp * per)


def first_last_split(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    """Megatron's split for --decoder-first/last-pipeline-num-layers: the middle stages are even.

    With VPP, the first (last) pipeline stage's layers are divided evenly over its virtual stages,
    as megatron's TransformerConfig requires.
    """
    ends = [n for n in (first, last) if n is not None]
    middle_stages = pp - len(ends)
    rest = num_layers - sum(ends)
    problems = []
    if any(n < 0 for n in ends) or rest < 0:
        problems.append(f"first/last stage layers {ends} exceed --num-layers {num_layers}")
    elif middle_stages == 0 and rest:
        problems.append(f"{rest} layers left over with no middle stage")
    elif middle_stages and rest % (middle_stages * vpp):
        problems.append(f"the remaining {rest} layers do not split evenly over {middle_stages} middle stages"
                        + (f" x {vpp} virtual stages" if vpp > 1 else ""))
    for n in ends:
        if n % vpp:
            problems.append(f"{n} first/last-stage layers not divisible by {vpp} virtual stages")
    require(problems, "first/last pipeline stage split")
    per_middle = rest // (middle_stages * vpp) if middle_stages else 0
    per_rank = [per_middle] * pp
    if first is not None:
        per_rank[0] = first // vpp
    if last is not None:
        per_rank[-1] = last // vpp
    return tuple(per_rank[i % pp] for i in range(pp * vpp))


def parallel_plan(ns: argparse.Namespace, shape: ModelShape, world_size: int) -> ParallelPlan:
    """ParallelPlan of a training run on `world_size` processes (unset sizes default to 1)."""
    tp = ns.tensor_model_parallel_size or 1
    pp = ns.pipeline_model_parallel_size or 1
    cp = ns.context_parallel_size or 1
    if cp != 1:
        raise CaptureError(f"--context-parallel-size {cp}: capture-megatron supports only 1")
    problems = []
    if tp >= 1 and (shape.num_attention_heads % tp or shape.groups % tp):
        problems.append(f"heads {shape.num_attention_heads} (query groups {shape.groups}) not divisible by TP {tp}")
    if tp < 1 or pp < 1 or world_size % (tp * pp * cp):
        problems.append(f"world size {world_size} is not divisible by TP {tp} x PP {pp}"
                        + (f" x CP {cp}" if cp > 1 else "")
                        + f"; use a multiple of {max(tp, 1) * max(pp, 1) * cp} processes")
    if problems:
        raise CaptureError("; ".join(problems))
    dp = world_size // (tp * pp * cp)
    mbs = ns.micro_batch_size or 1
    gbs = ns.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise CaptureError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x DP {dp}; "
                           f"use a multiple of {mbs * dp}")
    counts, vpp = _split(ns, shape.num_layers, pp)
    plan = ParallelPlan(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, micro_batch_size=mbs, global_batch_size=gbs,
                        layers_per_stage=counts, recompute=recompute(ns, pp),
                        sequence_parallel=bool(ns.sequence_parallel),
                        distributed_optimizer=bool(ns.use_distributed_optimizer))
    check_plan_fits_model(shape, plan)
    return plan


def optim_options(ns: argparse.Namespace) -> OptimOptions:
    """Adam / LR schedule / clipping settings."""
    return OptimOptions(lr=ns.lr, min_lr=ns.min_lr, lr_decay_style=ns.lr_decay_style,
                        lr_warmup_iters=ns.lr_warmup_iters, lr_decay_iters=ns.lr_decay_iters,
                        weight_decay=ns.weight_decay, clip_grad=ns.clip_grad, adam_beta1=ns.adam_beta1,
                        adam_beta2=ns.adam_beta2, adam_eps=ns.adam_eps,
                        initial_loss_scale=ns.initial_loss_scale)


def data_options(ns: argparse.Namespace) -> DataOptions:
    """Data source and tokenizer settings."""
    return DataOptions(mock_data=ns.mock_data, data_path=tuple(ns.data_path), split=ns.split,
                       tokenizer_type=ns.tokenizer_type, tokenizer_model=ns.tokenizer_model,
                       vocab_file=ns.vocab_file, merge_file=ns.merge_file, eod_mask_loss=ns.eod_mask_loss,
                       data_cache_path=ns.data_cache_path,
                       mock_vocab_size=(ns.vocab_size or 0) if ns.mock_data else 0)


def checkpoint_options(ns: argparse.Namespace) -> CheckpointOptions:
    """Save/resume settings."""
    return CheckpointOptions(save=ns.save, load=ns.load, save_interval=ns.save_interval,
                             no_load_optim=ns.no_load_optim, no_load_rng=ns.no_load_rng,
                             finetune=ns.finetune, exit_on_missing_checkpoint=ns.exit_on_missing_checkpoint)


def run_options(ns: argparse.Namespace) -> RunOptions:
    """Loop length, logging and measurement settings."""
    return RunOptions(train_iters=ns.train_iters, log_interval=ns.log_interval, seed=ns.seed,
                      memory_report=ns.memory_report, distributed_backend=ns.distributed_backend or "",
                      progress=not ns.no_progress, overlap_grad_reduce=ns.overlap_grad_reduce,
                      overlap_param_gather=ns.overlap_param_gather, exit_interval=ns.exit_interval)


def build_options(ns: argparse.Namespace) -> BuildOptions:
    """How the model is built (implementation, init, norm epsilon, RoPE base)."""
    return BuildOptions(transformer_impl=ns.transformer_impl, init_method_std=ns.init_method_std,
                        seed=ns.seed, layernorm_epsilon=ns.norm_epsilon, rotary_base=ns.rotary_base)
