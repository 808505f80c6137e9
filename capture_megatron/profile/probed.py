"""The model and the one-stage plan a probe builds (pure Python: the probe's variant and shape as
the ModelShape and ParallelPlan the builder takes)."""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan, Recompute
from capture_megatron.features.mla import LatentAttention
from capture_megatron.features.moe import Experts
from capture_megatron.profile.experts import probe_world
from capture_megatron.records import Probe


def model_shape(probe: Probe) -> ModelShape:
    """The ModelShape a probe builds (vocab given already padded, so padding is a no-op)."""
    v, s = probe.variant, probe.shape
    drop = 0.1 if v.dropout else 0.0
    return ModelShape(
        num_layers=max(probe.layers, 1),
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_attention_heads,
        seq_length=s.seq_length,
        vocab_size=s.padded_vocab,
        ffn_hidden_size=s.ffn_hidden_size,
        num_query_groups=s.num_query_groups,
        kv_channels=s.kv_channels,
        make_vocab_size_divisible_by=1,
        swiglu=v.swiglu,
        normalization=v.normalization,
        untie_embeddings_and_output_weights=v.untied,
        position_embedding_type=v.position_embedding_type,
        add_bias_linear=v.add_bias_linear,
        geglu=v.geglu,
        add_qkv_bias=v.add_qkv_bias,
        window_size=v.window_size,
        hidden_dropout=drop,
        attention_dropout=drop,
        dtype=v.dtype,
        moe=v.moe.experts if v.moe is not None else Experts(),
        qk_layernorm=v.qk_norm == "layernorm",
        qk_l2_norm=v.qk_norm == "l2",
        mla=v.mla if v.mla is not None else LatentAttention(),
        mtp_num_layers=v.mtp,
    )


def parallel_plan(probe: Probe) -> ParallelPlan:
    """A one-stage ParallelPlan carrying the probe's TP, DP, SP, recompute and optimizer."""
    v = probe.variant
    if v.recompute == "full":
        recompute = Recompute("full", "block", (probe.recompute_layers,))
    else:
        recompute = Recompute(v.recompute, modules=v.recompute_modules)
    b = probe.shape.micro_batch_size
    dp, ep, etp, cp = probe_world(probe)
    return ParallelPlan(
        tp=probe.shape.tp,
        pp=1,
        dp=dp,
        cp=cp,
        ep=ep,
        etp=etp,
        micro_batch_size=b,
        global_batch_size=b * dp,
        layers_per_stage=(max(probe.layers, 1),),
        recompute=recompute,
        sequence_parallel=v.sequence_parallel,
        distributed_optimizer=probe.distributed_optimizer,
        mtp_layers=v.mtp,
    )
