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


def gpu_layer_spec(spec, kernels: Kernels, local_norm):
    """megatron's local ModuleSpec `spec` with the kernel set's modules."""
    from capture_megatron.megatron.gpu.linear import te_column_linear
    from capture_megatron.megatron.gpu.select import core_attention

    te = kernels.transformer_impl == "transformer_engine"
    layer = spec.submodules
    norm = layer_norm(kernels, local_norm)
    attn, mlp = layer.self_attention, layer.mlp
    attn_parts = dataclasses.replace(attn.submodules, core_attention=core_attention(kernels))
    if te:
        attn_parts = dataclasses.replace(attn_parts, linear_qkv=te_column_linear())
        mlp = dataclasses.replace(
            mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=te_column_linear())
        )
    layer = dataclasses.replace(
        layer,
        input_layernorm=norm,
        pre_mlp_layernorm=norm,
        self_attention=dataclasses.replace(attn, submodules=attn_parts),
        mlp=mlp,
    )
    return dataclasses.replace(spec, submodules=layer)


def layer_norm(kernels: Kernels, local_norm):
    """TE's fused norm for transformer_engine, else the local spec's norm."""
    if kernels.transformer_impl == "transformer_engine":
        from capture_megatron.megatron.gpu.norm import TENorm

        return TENorm
    return local_norm
