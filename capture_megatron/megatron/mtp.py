"""Multi-token prediction (--mtp-num-layers) in the model builder, as Megatron-LM builds it.

Megatron-LM's gpt_builders.gpt_builder (core_v0.16.1) gives GPTModel an MTP block spec whose
layers (megatron/core/transformer/multi_token_prediction.py MultiTokenPredictionLayer) each hold
two norms (enorm over the embedding of the shifted tokens, hnorm over the hidden states), a
column-parallel linear eh_proj [2h -> h], one transformer layer with the spec of the decoder's last
layer, and a final norm; they share the model's embedding and output layer. Without a custom
layout all MTP layers sit on the last pipeline stage (the last virtual stage of the last rank);
GPTModel then also builds the embedding there (a copy of the first stage's, tied to it through
the embedding group) and computes one extra loss per MTP layer over labels shifted once more.

The norms and eh_proj come from megatron's backend providers: Transformer Engine's TENorm and
TEColumnParallelLinear on a GPU with TE, the local spec's norm and ColumnParallelLinear otherwise.
On the CPU kernel set the norm is LocalNorm (the local spec's torch norm, usable with sequence
parallelism); on the fake-cuda device the GPU kernel set's TENorm and TE-gathering column linear
(capture_megatron.emulate.gpu) stand in for TE's, as in the decoder layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from capture_megatron.config import ModelShape
from capture_megatron.megatron import versioned

if TYPE_CHECKING:
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from capture_megatron.megatron.backend import Backend


def config_fields(shape: ModelShape) -> dict:
    """TransformerConfig's MTP fields: mtp_num_layers (None without MTP, as Megatron-LM sends an
    absent --mtp-num-layers); the loss scaling factor keeps megatron-core's default (it scales a
    loss, no memory)."""
    return {"mtp_num_layers": shape.mtp_num_layers or None}


def _parts(backend: Backend) -> tuple[type, type]:
    """(norm, column-parallel linear) of the MTP layers for the backend."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from capture_megatron.megatron.norms import LocalNorm

    kernels = backend.kernels
    if backend.real_te:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TENorm,
        )

        return TENorm, TEColumnParallelLinear
    if backend.emulated and kernels is not None:
        from capture_megatron.emulate.gpu.linear import te_column_linear
        from capture_megatron.megatron.gpu_spec import layer_norm

        te = kernels.transformer_impl == "transformer_engine"
        return layer_norm(kernels, LocalNorm), te_column_linear() if te else ColumnParallelLinear
    return LocalNorm, ColumnParallelLinear


def block_spec(
    shape: ModelShape, backend: Backend, layer_spec: ModuleSpec
) -> MultiTokenPredictionBlockSubmodules | None:
    """MultiTokenPredictionBlockSubmodules of the model's MTP layers, each with the transformer
    layer `layer_spec` (the decoder's last layer's, as Megatron-LM takes it); None without MTP."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not shape.mtp_num_layers:
        return None
    norm, linear = _parts(backend)
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm,
            hnorm=norm,
            eh_proj=linear,
            layer_norm=norm,
            **{versioned.mtp_layer_field(): layer_spec},
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * shape.mtp_num_layers)


def moe_layer_spec(config: TransformerConfig, shape: ModelShape, backend: Backend) -> ModuleSpec:
    """The spec of an MoE model's last decoder layer (megatron-core's
    get_gpt_decoder_layer_specs, as Megatron-LM picks the MTP layer's), with the builder's norms
    or the GPU kernel set's modules: for a last chunk that holds no decoder layer."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    from capture_megatron.megatron.norms import LocalNorm

    # megatron-core 0.16.1 annotates TransformerBlockSubmodules but returns the list of layer specs
    spec = get_gpt_decoder_layer_specs(  # type: ignore[index]
        config, use_transformer_engine=backend.real_te, normalization=shape.normalization
    )[-1]
    if backend.real_te:
        return spec
    if backend.emulated and backend.kernels is not None:
        from capture_megatron.megatron.gpu_spec import gpu_layer_spec

        return gpu_layer_spec(spec, backend.kernels, LocalNorm, shape.moe.moe_grouped_gemm)
    layer = dataclasses.replace(
        spec.submodules, input_layernorm=LocalNorm, pre_mlp_layernorm=LocalNorm
    )
    return dataclasses.replace(spec, submodules=layer)
