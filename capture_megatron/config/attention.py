"""LatentAttention: multi-latent attention (MLA, DeepSeek-V2/V3's) in Megatron's terms, each field
with its Megatron-LM flag and default (core_v0.16.1, megatron/training/arguments.py
_add_mla_args). Off unless --multi-latent-attention; then the query and key/value projections go
through low-rank latents and the per-head widths below replace --kv-channels. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config.fields import flag
from capture_megatron.errors import require
from capture_megatron.serial import JsonMixin


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
        require(p, "multi-latent attention")

    @property
    def enabled(self) -> bool:
        """Whether the model uses multi-latent attention."""
        return self.multi_latent_attention

    @property
    def q_head_dim(self) -> int:
        """A query (and key) head's whole width: the no-position part plus the rotary part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim
