"""Query/key norms and multi-latent attention (MLA) for megatron-core, as Megatron-LM builds them.

Megatron-LM (core_v0.16.1 gpt_builders.py, arguments.py core_transformer_config_from_args) turns
--multi-latent-attention into an MLATransformerConfig and asks the layer specs for MLA and the
query/key norms (get_gpt_layer_local_spec / get_gpt_layer_with_transformer_engine_spec /
get_gpt_decoder_block_spec: qk_layernorm, multi_latent_attention, qk_l2_norm):
- --qk-layernorm: a --normalization norm of each query and key head (TE: TENorm), normalised
  shape the head width; with MLA the norms of the query latent and the key/value latent instead
  (local spec: q_layernorm / kv_layernorm; TE spec: fused into the up-projections'
  LayerNormLinear). Without --qk-layernorm an MLA layer has no latent norms.
- --qk-l2-norm: megatron-core's L2Norm (no weights) on each query and key head.
- MLA: the YaRN (or plain, --rope-type rope) rotary embedding inside the attention on the
  qk_pos_emb_head_dim part of each head, whatever --position-embedding-type says (GPTModel builds
  no rotary embedding for MLA; a learned absolute one is still added); --kv-channels is not used;
  the core attention gets query/key heads of qk_head_dim + qk_pos_emb_head_dim and value heads of
  v_head_dim.

The local spec's modules are adjusted here as the rest of the local spec is (builder.layer_spec):
the norms become LocalNorm (torch's norms, usable with sequence parallelism), L2Norm runs its
formula eagerly (megatron compiles it with torch.compile), and megatron's DotProductAttention,
which takes no key / value head widths, gets them (MLA builds its core attention with them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch

from capture_megatron.config import ModelShape

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig


def config_fields(shape: ModelShape) -> dict:
    """TransformerConfig fields of the query/key norms and MLA (MLATransformerConfig's when
    `shape` has multi-latent attention)."""
    fields: dict = {"qk_layernorm": shape.qk_layernorm, "qk_l2_norm": shape.qk_l2_norm}
    mla = shape.mla
    if not mla.enabled:
        return fields
    from capture_megatron.megatron import versioned

    versioned.check_mla_query_norm(shape.qk_layernorm, mla.q_lora)
    return {
        **fields,
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_head_dim,
        "qk_pos_emb_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_type": mla.rope,
        "rotary_base": shape.rotary_base,
        "rotary_scaling_factor": mla.rotary_scaling_factor,
        "mscale": mla.mscale,
        "mscale_all_dim": mla.mscale_all_dim,
    }


def config_class(shape: ModelShape) -> type[TransformerConfig]:
    """megatron-core's config class for the model: MLATransformerConfig with MLA."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    return MLATransformerConfig if shape.mla.enabled else TransformerConfig


def spec_flags(shape: ModelShape) -> dict[str, Any]:
    """The keyword arguments megatron-core's layer-spec functions take for these features."""
    return {
        "qk_layernorm": shape.qk_layernorm,
        "multi_latent_attention": shape.mla.enabled,
        "qk_l2_norm": shape.qk_l2_norm,
    }


def check_local_latents(shape: ModelShape, tp: int) -> None:
    """CaptureError when megatron-core's local MLA spec cannot split the latents over `tp`: its
    down-projections are column-parallel linears (Transformer Engine's are duplicated on every
    rank and need no split)."""
    from capture_megatron.errors import CaptureError

    mla = shape.mla
    widths = {"--q-lora-rank": mla.q_lora_rank, "--kv-lora-rank + --qk-pos-emb-head-dim":
              mla.kv_lora_rank + mla.qk_pos_emb_head_dim}  # fmt: skip
    bad = [f"{name} {w}" for name, w in widths.items() if mla.enabled and w % tp]
    if bad:
        raise CaptureError(
            f"{', '.join(bad)} not divisible by TP {tp}: megatron-core's local multi-latent "
            "attention splits its down-projections over the tensor-parallel ranks"
        )


class EagerL2Norm(torch.nn.Module):
    """megatron-core's L2Norm (x * rsqrt(mean(x^2) + eps) in fp32, back in x's dtype), run
    eagerly: megatron wraps the formula in jit_fuser (torch.compile)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **_unused: Any) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The L2-normalised x."""
        x_float = x.float()
        return (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def _replace_norm(module: Any, norm: type, l2: type) -> Any:
    """`norm` for a norm spec entry, `l2` for megatron's L2Norm, identities kept."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm

    if module is None or module is IdentityOp:
        return module
    return l2 if module is L2Norm else norm


def attention_norms(attention_spec: ModuleSpec, norm: type, l2: type = EagerL2Norm) -> ModuleSpec:
    """The self-attention ModuleSpec with its query/key (or MLA latent) norms replaced by `norm`
    and megatron's L2Norm by `l2`."""
    parts: Any = attention_spec.submodules  # megatron-core types a spec's submodules `object`
    names = [n for n in ("q_layernorm", "k_layernorm", "kv_layernorm") if hasattr(parts, n)]
    changes = {n: _replace_norm(getattr(parts, n), norm, l2) for n in names}
    return dataclasses.replace(attention_spec, submodules=dataclasses.replace(parts, **changes))


def is_latent(attention_spec: ModuleSpec) -> bool:
    """Whether a self-attention ModuleSpec is megatron-core's MLA."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    return isinstance(attention_spec.submodules, MLASelfAttentionSubmodules)


@functools.cache
def with_head_widths(core_attention: type) -> type:
    """`core_attention` taking MLA's key and value head widths (k_channels, v_channels):
    megatron's DotProductAttention takes neither and sizes its output by --kv-channels; this
    subclass sizes it by the value heads. Classes that take them are returned as they are."""
    init = core_attention.__init__  # type: ignore[misc]  # a class's, not an instance's
    if "v_channels" in inspect.signature(init).parameters:
        return core_attention

    class LatentCore(core_attention):
        """The core attention with MLA's head widths (query/key k_channels, value v_channels)."""

        def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any,
                     attention_type: str, attention_dropout: float | None = None,
                     softmax_scale: float | None = None, k_channels: int | None = None,
                     v_channels: int | None = None, cp_comm_type: str | None = None,
                     pg_collection: Any = None) -> None:  # fmt: skip
            super().__init__(
                config, layer_number, attn_mask_type, attention_type,
                attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type, pg_collection=pg_collection,
            )  # fmt: skip
            del k_channels  # MLA passes the softmax scale of its query/key width
            if v_channels is not None:  # megatron's Attention first builds one without them
                heads = self.num_attention_heads_per_partition
                self.hidden_size_per_partition = v_channels * heads

    LatentCore.__name__ = LatentCore.__qualname__ = f"Latent{core_attention.__name__}"
    return LatentCore


def latent_core(layer_spec: ModuleSpec) -> ModuleSpec:
    """A transformer-layer ModuleSpec whose MLA core attention takes MLA's head widths (other
    layers unchanged)."""
    parts: Any = layer_spec.submodules  # typed `object` by megatron-core
    attention = parts.self_attention
    if not is_latent(attention):
        return layer_spec
    core = with_head_widths(attention.submodules.core_attention)
    inner = dataclasses.replace(attention.submodules, core_attention=core)
    layer = dataclasses.replace(
        parts, self_attention=dataclasses.replace(attention, submodules=inner)
    )
    return dataclasses.replace(layer_spec, submodules=layer)


def rotary_tables_built_in_fp32(model: torch.nn.Module) -> None:
    """Record fp32 as the dtype of the model's MLA YaRN tables (a model built under another
    default dtype, as fake mode builds it). A real run builds them in fp32 (the default dtype)
    before Float16Module casts them, so their cache records fp32 and fused MLA RoPE re-caches
    them for the sequence in the activation dtype at the first forward."""
    for module in model.modules():
        if hasattr(module, "dtype_cached"):
            module.dtype_cached = torch.float32  # type: ignore[assignment]  # YaRN's cache: a dtype
