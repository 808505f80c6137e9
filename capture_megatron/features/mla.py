"""LatentAttention: multi-latent attention (MLA, DeepSeek-V2/V3's) in Megatron's terms, each field
with its Megatron-LM flag and default (core_v0.16.1, megatron/training/arguments.py
_add_mla_args, and --rope-type). Off unless --multi-latent-attention; then the query and key/value
projections go through low-rank latents and the per-head widths below replace --kv-channels
(megatron-core's MLATransformerConfig; its YaRN fields without a Megatron-LM flag keep their
defaults: original_max_position_embeddings 4096, beta_fast 32, beta_slow 1). Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from capture_megatron.errors import require
from capture_megatron.fields import flag
from capture_megatron.serial import JsonMixin

ROPE_TYPES = ("rope", "yarn")
"""Megatron-LM's --rope-type choices."""


@dataclass(frozen=True)
class LatentAttention(JsonMixin):
    """Multi-latent attention (Megatron's MLA flags); off unless `multi_latent_attention`."""

    multi_latent_attention: bool = flag("--multi-latent-attention", False)
    """Use multi-latent attention (MLA) instead of the standard self-attention."""
    q_lora_rank: int = flag("--q-lora-rank", 0, note="(absent or 0: no query compression)")
    """Rank of the query's low-rank compression; 0 means the queries are projected directly
    (Megatron-LM's None)."""
    kv_lora_rank: int = flag("--kv-lora-rank", 32)
    """Rank of the key/value low-rank compression (the latent MLA caches)."""
    qk_head_dim: int = flag("--qk-head-dim", 128)
    """Per-head width of the query/key part without position embedding."""
    qk_pos_emb_head_dim: int = flag("--qk-pos-emb-head-dim", 64)
    """Per-head width of the query/key part that carries the rotary position embedding."""
    v_head_dim: int = flag("--v-head-dim", 128)
    """Per-head width of the values."""
    rotary_scaling_factor: float = flag("--rotary-scaling-factor", 1.0)
    """YaRN rotary scaling factor of MLA (changes values, not shapes)."""
    mscale: float = flag("--mscale", 1.0)
    """YaRN mscale of MLA (changes values, not shapes)."""
    mscale_all_dim: float = flag("--mscale-all-dim", 0.0)
    """YaRN mscale_all_dim of MLA (changes values, not shapes)."""
    rope_type: str = flag(
        "--rope-type", "", choices=ROPE_TYPES, note="(absent: yarn with MLA, rope otherwise)"
    )
    """Rotary embedding of the attention: rope, or yarn (YaRN, multi-latent attention only);
    empty: Megatron-LM's default for the attention kind."""

    def __post_init__(self) -> None:
        p = []
        for name in ("q_lora_rank",):
            if getattr(self, name) < 0:
                p.append(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 0")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                p.append(f"--{name.replace('_', '-')} {getattr(self, name)} must be positive")
        if self.qk_pos_emb_head_dim < 0:
            p.append(f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} must be >= 0")
        if self.rotary_scaling_factor <= 0 or self.mscale <= 0 or self.mscale_all_dim < 0:
            p.append(
                f"--rotary-scaling-factor {self.rotary_scaling_factor} and --mscale "
                f"{self.mscale} must be positive, --mscale-all-dim {self.mscale_all_dim} >= 0"
            )
        if self.rope_type not in ("", *ROPE_TYPES):
            p.append(f"--rope-type {self.rope_type!r} not one of {ROPE_TYPES}")
        if self.rope_type == "yarn" and not self.multi_latent_attention:
            p.append(
                "--rope-type yarn needs --multi-latent-attention (Megatron-LM: common attention "
                "only supports rope)"
            )
        require(p, "multi-latent attention")

    @property
    def enabled(self) -> bool:
        """Whether the model uses multi-latent attention."""
        return self.multi_latent_attention

    @property
    def q_head_dim(self) -> int:
        """A query (and key) head's whole width: the no-position part plus the rotary part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def rope(self) -> str:
        """The rotary embedding megatron-core builds: --rope-type, else yarn with MLA (its
        MLATransformerConfig default) and rope otherwise."""
        return self.rope_type or ("yarn" if self.multi_latent_attention else "rope")

    @property
    def q_lora(self) -> int | None:
        """MLATransformerConfig's q_lora_rank: None when the queries are projected directly."""
        return self.q_lora_rank or None

    def shapes_only(self) -> LatentAttention:
        """This attention with the fields that change values, not tensors (the YaRN scaling),
        at their defaults and the RoPE kind resolved: what a memory model is keyed by."""
        return dataclasses.replace(
            self, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0, rope_type=self.rope
        )


def attention_parameters(shape: Any, tp: int = 1, te: bool = False) -> int:
    """Parameters of one layer's self-attention on one of `tp` tensor-parallel ranks, as
    megatron-core 0.16.1 builds them for a ModelShape `shape`: the projections (and their biases),
    the query/key norms or MLA's latent norms; not the layer's input norm. `te`: Transformer
    Engine's spec, whose MLA down-projections are duplicated on every rank (the local spec splits
    them over the ranks)."""
    h, heads, norm = shape.hidden_size, shape.num_attention_heads // tp, shape.normalization
    per_norm = 2 if norm == "LayerNorm" else 1
    proj_bias = h if shape.add_bias_linear else 0
    mla = shape.mla
    if not mla.enabled:
        d, groups = shape.head_dim, shape.groups // tp
        qkv = (heads + 2 * groups) * d
        qkv_bias = qkv if shape.add_bias_linear or shape.add_qkv_bias else 0
        norms = 2 * per_norm * d if shape.qk_layernorm else 0
        return h * qkv + qkv_bias + heads * d * h + proj_bias + norms
    split = 1 if te else tp
    up_q = heads * mla.q_head_dim
    query = h * up_q  # the direct query projection, or the down- and up-projections:
    query = h * mla.q_lora_rank // split + mla.q_lora_rank * up_q if mla.q_lora_rank else query
    down_kv = h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) // split
    up_kv = mla.kv_lora_rank * heads * (mla.qk_head_dim + mla.v_head_dim)
    norms = per_norm * (mla.q_lora_rank + mla.kv_lora_rank) if shape.qk_layernorm else 0
    return query + down_kv + up_kv + heads * mla.v_head_dim * h + proj_bias + norms
