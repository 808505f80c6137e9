"""Mixture-of-experts layers in the model builder: Megatron's MoE fields of TransformerConfig, the
decoder block spec that mixes MoE and dense layers, and what the CPU kernel set cannot run.

The fields go to megatron-core's TransformerConfig as Megatron-LM's
core_transformer_config_from_args sends them (megatron/training/arguments.py, core_v0.16.1):
``num_moe_experts`` None for a dense model, ``moe_layer_freq`` an int or a 0/1 list,
``moe_ffn_hidden_size`` with the dense width as default, the optional sizes and factors None when
not given, expert parallel sizes from the plan.

The layer specs follow Megatron-LM's gpt_builders.gpt_builder: with experts, megatron-core's
get_gpt_decoder_block_spec builds every layer's spec from --moe-layer-freq (an MoE spec or a
dense spec per layer) and keeps the layers of this pipeline rank and virtual stage (the layout's
layer ids, or Megatron's offset without a layout). On the CPU kernel set the local spec's norms
become LocalNorm (as builder.layer_spec does for dense layers); on a GPU with Transformer Engine
the TE specs are used unchanged. On the fake-cuda device (the GPU kernel set under
FakeTensorMode) the local specs get the kernel set's modules (capture_megatron.megatron.gpu_spec).

A probe's routing bound (Experts.routing_bound) pads every expert to a capacity; megatron-core's
config refuses a capacity factor with sinkhorn routing, although its router applies the capacity
after any load-balancing type: for sinkhorn the bound is set on the config after its checks
(bound_sinkhorn). DeepEP runs unpadded (megatron-core refuses padding with it): its probe's bound
rides on the config for the GPU kernel set's DeepEP (flex_forecast).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.rules.megatron import CPU_REFUSAL

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from capture_megatron.features.moe import Experts


def layer_freq(shape: ModelShape) -> int | list[int]:
    """--moe-layer-freq as Megatron-LM's moe_freq_type gives it to TransformerConfig: an int N, or
    the list of 0/1 a list expression evaluates to (one entry per layer, checked)."""
    text = shape.moe.moe_layer_freq.strip()
    if text.isdigit():
        return int(text)
    return [int(v) for v in shape.moe.pattern(shape.num_layers)]


def config_fields(shape: ModelShape, plan: ParallelPlan) -> dict:
    """TransformerConfig's MoE fields for `shape` split as `plan` says (dense: num_moe_experts
    None and the expert sizes of the plan, which Megatron checks)."""
    moe = shape.moe
    sizes = {
        "expert_model_parallel_size": plan.ep,
        "expert_tensor_parallel_size": plan.expert_tp,
    }
    if not moe.enabled:
        return {"num_moe_experts": None, **sizes}
    capacity = moe.moe_expert_capacity_factor or None
    return {
        "num_moe_experts": moe.num_experts,
        "moe_layer_freq": layer_freq(shape),
        "moe_ffn_hidden_size": shape.moe_ffn,
        "moe_shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size or None,
        "moe_router_topk": moe.moe_router_topk,
        "moe_token_dispatcher_type": moe.moe_token_dispatcher_type,
        "moe_flex_dispatcher_backend": moe.moe_flex_dispatcher_backend,
        "moe_expert_capacity_factor": None if _sinkhorn_bound(moe) else capacity,
        "moe_pad_expert_input_to_capacity": moe.moe_pad_expert_input_to_capacity
        and not _sinkhorn_bound(moe),
        "moe_grouped_gemm": moe.moe_grouped_gemm,
        "moe_router_load_balancing_type": moe.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": moe.moe_aux_loss_coeff,
        "moe_router_score_function": moe.moe_router_score_function,
        "moe_router_pre_softmax": moe.moe_router_pre_softmax,
        "moe_router_dtype": moe.moe_router_dtype or None,
        "moe_router_force_load_balancing": moe.moe_router_force_load_balancing,
        **sizes,
    }


def _sinkhorn_bound(moe: Experts) -> bool:
    return moe.routing_bound and moe.moe_router_load_balancing_type == "sinkhorn"


def routing_bound(config: TransformerConfig, shape: ModelShape) -> None:
    """Give a probe's config its routing bound where megatron's config checks refuse it: a
    sinkhorn router its capacity and padding (bound_sinkhorn), DeepEP its forecast
    (flex_forecast); see the module docstring."""
    bound_sinkhorn(config, shape)
    flex_forecast(config, shape)


def bound_sinkhorn(config: TransformerConfig, shape: ModelShape) -> None:
    """Give a probe's sinkhorn router its routing bound (capacity and padding) after megatron's
    config checks, which refuse a capacity with sinkhorn (see the module docstring)."""
    if _sinkhorn_bound(shape.moe):
        config.moe_expert_capacity_factor = shape.moe.moe_expert_capacity_factor
        config.moe_pad_expert_input_to_capacity = shape.moe.moe_pad_expert_input_to_capacity


def flex_forecast(config: TransformerConfig, shape: ModelShape) -> None:
    """Give a DeepEP probe's config its routing forecast: megatron-core refuses DeepEP with padded
    expert inputs, so a probe runs dropless routing as the run does and the GPU kernel set's
    DeepEP receives the tokens of the forecast factor (the probe's --moe-imbalance-factor, or
    its capacity factor) from every rank (capture_megatron.emulate.gpu.deepep.FACTOR; megatron-core
    never reads the attribute)."""
    moe = shape.moe
    deepep = moe.moe_token_dispatcher_type == "flex" and moe.moe_flex_dispatcher_backend == "deepep"
    if moe.enabled and moe.routing_bound and deepep:
        factor = moe.moe_expert_capacity_factor or moe.moe_imbalance_factor
        config.flex_routing_factor = factor  # type: ignore[attr-defined]  # read by the emulation


def _local_norms(spec: ModuleSpec, norm: type) -> ModuleSpec:
    """A layer spec of the local spec with its norms (query/key norms included) replaced by
    `norm`."""
    from capture_megatron.megatron.attention import attention_norms

    parts: Any = spec.submodules  # typed `object` by megatron-core
    attention = attention_norms(parts.self_attention, norm)
    layer = dataclasses.replace(
        parts, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attention
    )
    return dataclasses.replace(spec, submodules=layer)


def block_spec(
    config: TransformerConfig, shape: ModelShape, te: bool, vp_stage: int | None, num_layers: int
) -> TransformerBlockSubmodules:
    """TransformerBlockSubmodules of one model chunk of an MoE model: megatron-core's
    get_gpt_decoder_block_spec for this pipeline rank and `vp_stage` (TE specs when `te`, else
    the local spec with LocalNorm). `num_layers` is what the plan places there (checked; 0 for a
    chunk of only the ends, which megatron's spec cannot express when its config has one layer,
    as a probe's has)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from capture_megatron.megatron.norms import LocalNorm

    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=te,
        normalization=shape.normalization,
        qk_l2_norm=shape.qk_l2_norm,
        vp_stage=vp_stage,
    )
    if num_layers == 0:
        block = dataclasses.replace(block, layer_specs=[])
    assert block.layer_specs is not None, "megatron-core's decoder block spec lists its layers"
    if len(block.layer_specs) != num_layers:
        raise RuntimeError(
            f"megatron-core placed {len(block.layer_specs)} layers in this chunk, the plan "
            f"{num_layers}"
        )
    if te:
        return block
    return dataclasses.replace(
        block,
        layer_specs=[_local_norms(s, LocalNorm) for s in block.layer_specs],
        # megatron-core annotates a spec or an instance; its own block specs pass a class too
        layer_norm=LocalNorm,  # type: ignore[arg-type]
    )


def cpu_refusals(shape: ModelShape) -> list[str]:
    """What of `shape`'s experts the CPU kernel set (the local spec, no CUDA) cannot run, one
    sentence per flag (empty for a dense model)."""
    moe = shape.moe
    if not moe.enabled:
        return []
    p = []
    if moe.moe_grouped_gemm:
        p.append(
            "--moe-grouped-gemm: the local spec builds megatron-core's GroupedMLP, which needs the "
            "grouped_gemm package's CUDA kernels (on a GPU, Transformer Engine's TEGroupedMLP); "
            "leave it out to run the experts one after another (SequentialMLP, the same function)"
        )
    if moe.moe_token_dispatcher_type == "flex":
        p.append(CPU_REFUSAL)
    if shape.add_bias_linear:
        p.append(
            "linear biases (the default without --disable-bias-linear) fail in the local spec's "
            "experts: megatron-core's MLP adds the expert bias in place (output += bias x "
            "probability) to the output of RowParallelLinear's custom autograd function, which "
            "autograd forbids; give --disable-bias-linear"
        )
    return p


def refuse_on_cpu(shape: ModelShape) -> None:
    """CaptureError naming every MoE flag the CPU kernel set cannot run."""
    p = cpu_refusals(shape)
    if p:
        raise CaptureError(
            "the CPU kernel set (megatron-core's local spec without CUDA) cannot train this "
            "mixture of experts: " + "; ".join(p) + "."
        )
