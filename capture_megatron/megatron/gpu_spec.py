"""The transformer-layer spec of the GPU kernel set on the fake-cuda device.

Megatron-LM builds `get_gpt_layer_with_transformer_engine_spec` (TE's LayerNormLinear for
linear_qkv and linear_fc1 with the norms fused in, TERowParallelLinear, TEDotProductAttention,
TENorm) or, with --transformer-impl local, `get_gpt_layer_local_spec`. TE cannot be installed
without a GPU, so the fake-cuda device builds megatron's local spec with the modules of this
package that keep what TE's keep: a separate TE norm in front of a column-parallel linear keeps
what LayerNormLinear keeps (the norm input, fp32 statistics, the normalised output), the core
attention of the chosen backend, and TE's transient sequence-parallel gathers.
"""

from __future__ import annotations

import dataclasses

from capture_megatron.config import Kernels
from capture_megatron.megatron import versioned


def linear_precision(kernels: Kernels):
    """The Precision TE's linear layers compute in under `kernels` (capture_megatron.emulate.gpu
    .common; None: the activation dtype): FP8's (capture_megatron.emulate.gpu.fp8) with
    --fp8-format."""
    from capture_megatron.emulate.gpu import fp8

    return fp8.setting(kernels)


def gpu_layer_spec(spec, kernels: Kernels, local_norm, grouped: bool | None = None):
    """megatron's local ModuleSpec `spec` with the kernel set's modules (`grouped`: the MoE
    experts are one grouped GEMM, --moe-grouped-gemm; None: as the local spec builds them)."""
    from capture_megatron.emulate.gpu.compiled import CompiledL2Norm
    from capture_megatron.emulate.gpu.select import core_attention
    from capture_megatron.megatron.attention import attention_norms

    te = kernels.transformer_impl == "transformer_engine"
    layer = spec.submodules
    norm = layer_norm(kernels, local_norm)
    attn, mlp = layer.self_attention, layer.mlp
    attn_parts = dataclasses.replace(attn.submodules, core_attention=core_attention(kernels))
    if te:
        precision, ub = linear_precision(kernels), kernels.tp_comm_overlap
        attn_parts = _te_projections(attn_parts, precision, ub)
        moe = hasattr(versioned.submodules_of(mlp), "experts")
        mlp = moe_spec(mlp, precision, grouped) if moe else _te_mlp(mlp, precision, ub)
    attn = dataclasses.replace(attn, submodules=attn_parts)
    layer = dataclasses.replace(
        layer,
        input_layernorm=norm,
        pre_mlp_layernorm=norm,
        self_attention=attention_norms(attn, norm, CompiledL2Norm),
        mlp=mlp,
    )
    return dataclasses.replace(spec, submodules=layer)


def _te_projections(parts, precision=None, userbuffers: bool = False):
    """Self-attention submodules with TE's projections: linear_qkv as TE's LayerNormLinear (its
    gathers into userbuffers with --tp-comm-overlap), linear_proj as TE's row-parallel Linear;
    for multi-latent attention (TE spec: get_gpt_layer_with_transformer_engine_spec) the down-
    projections as TE's duplicated Linear (megatron's TELinear, the whole weight on every TP
    rank) and the up-projections (or the direct query projection) column-parallel, gathering
    as TE's do; their latent norms (--qk-layernorm) become TE norms with the other norms. Every
    one keeps what TE's layers keep in `precision` (None: bf16)."""
    from capture_megatron.emulate.gpu.linear import (
        duplicated_linear,
        te_column_linear,
        te_row_linear,
    )

    proj = te_row_linear(precision)
    if not hasattr(parts, "linear_kv_down_proj"):
        return dataclasses.replace(
            parts, linear_qkv=te_column_linear(precision, userbuffers), linear_proj=proj
        )
    column, down = te_column_linear(precision), duplicated_linear(precision)
    return dataclasses.replace(
        parts,
        linear_q_proj=column,
        linear_q_down_proj=down,
        linear_q_up_proj=column,
        linear_kv_down_proj=down,
        linear_kv_up_proj=column,
        linear_proj=proj,
    )


def _te_mlp(mlp, precision=None, userbuffers: bool = False):
    """An MLP spec whose linear_fc1 gathers as TE's does (into userbuffers with
    --tp-comm-overlap), both linear layers keeping what TE's keep in `precision`
    (None: bf16)."""
    from capture_megatron.emulate.gpu.linear import te_column_linear, te_row_linear

    fc1 = te_column_linear(precision, userbuffers)
    parts = versioned.submodules_of(mlp)
    parts = dataclasses.replace(parts, linear_fc1=fc1, linear_fc2=te_row_linear(precision))
    return versioned.with_submodules(mlp, parts)


def moe_spec(mlp, precision=None, grouped: bool | None = None):
    """megatron's local MoE spec as TE's: the shared experts' linear_fc1 gathers as TE's does;
    grouped experts (versioned.grouped_experts: 0.16's local GroupedMLP, 0.19's `grouped`)
    become megatron's TEGroupedMLP on the
    kernel set's GroupedLinear (capture_megatron.emulate.gpu.grouped). Sequential experts keep
    megatron's linear layers in bf16 (the dispatcher does their communication, so TE's Linear
    keeps the same) and TE's layers' in `precision`; so do the grouped and shared experts."""
    from capture_megatron.emulate.gpu.grouped import grouped_classes

    parts = versioned.submodules_of(mlp)
    experts = parts.experts
    if versioned.grouped_experts(experts, grouped):
        experts = versioned.grouped_experts_spec(*grouped_classes(precision))
    elif precision is not None:
        experts = _te_mlp(experts, precision)
    shared = parts.shared_experts
    if shared is not None:
        shared = _te_mlp(shared, precision)
    return versioned.with_submodules(
        mlp, dataclasses.replace(parts, experts=experts, shared_experts=shared)
    )


def layer_norm(kernels: Kernels, local_norm):
    """TE's fused norm for transformer_engine, else the local spec's norm."""
    if kernels.transformer_impl == "transformer_engine":
        from capture_megatron.emulate.gpu.norm import TENorm

        return TENorm
    return local_norm


def gpu_block_spec(block, kernels: Kernels, grouped: bool | None = None):
    """A decoder block spec of megatron's local layers (MoE and dense, LocalNorm) with the kernel
    set's modules in every layer and as the final norm (`grouped`: as gpu_layer_spec's)."""
    from capture_megatron.megatron.norms import LocalNorm

    layers = [gpu_layer_spec(s, kernels, LocalNorm, grouped) for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers, layer_norm=layer_norm(kernels, LocalNorm))


def keep_fused_norms(model, kernels: Kernels) -> None:
    """Selective recompute of 'layernorm' as on the GPU: Transformer Engine's spec fuses the
    attention's input norm (standard attention) and a dense layer's pre-MLP norm into
    LayerNormLinear, leaving megatron-core an IdentityOp it does not recompute; the kernel set
    builds those norms as separate modules (keeping what LayerNormLinear keeps), so their
    recompute is switched off here as megatron-core's IdentityOp test would. MLA's input norm and
    an MoE layer's pre-MLP norm are TE norms of their own and stay recomputed."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if kernels.transformer_impl != "transformer_engine":
        return
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        if not isinstance(layer.self_attention, MultiLatentAttention):
            layer.recompute_input_layernorm = False
        if not layer.is_moe_layer:
            layer.recompute_pre_mlp_layernorm = False
