"""DeepSeek-V2 / V3's multi-latent attention and multi-token prediction in a Hugging Face config
(deepseek_v2, deepseek_v3; Moonlight is deepseek_v3) as Megatron-LM's flags, the way
NVIDIA's DeepSeek-V3 launch script spells them (Megatron-LM core_v0.16.1,
docs/discussions/megatron-fsdp-user-guide/example-scripts/sbatch_mfsdp_deepseek_v3.sh:
--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
--qk-pos-emb-head-dim 64 --v-head-dim 128 --kv-channels 128 --qk-layernorm --rotary-scaling-factor
40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1). Pure Python.

- q_lora_rank (null: queries projected directly, Megatron's absent --q-lora-rank), kv_lora_rank,
  qk_nope_head_dim (--qk-head-dim), qk_rope_head_dim (--qk-pos-emb-head-dim), v_head_dim;
- the latents' RMSNorms (q_a_layernorm, kv_a_layernorm) are Megatron's --qk-layernorm under MLA;
- rope_scaling of type yarn: factor, mscale, mscale_all_dim (Megatron's MLA RoPE is YaRN by
  default); other scalings with its original_max_position_embeddings other than 4096, beta_fast
  other than 32 or beta_slow other than 1 (megatron-core's defaults, with no flag) are refused;
- num_nextn_predict_layers: --mtp-num-layers.
"""

from __future__ import annotations

from typing import Any

from capture_megatron.errors import CaptureError
from capture_megatron.features.mla import LatentAttention

YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
"""YaRN settings megatron-core's MLATransformerConfig fixes (no Megatron-LM flag sets them)."""
DEFAULT_MLA = {
    "deepseek_v2": (1536, 512, 128, 64, 128),
    "deepseek_v3": (1536, 512, 128, 64, 128),
}
"""transformers' defaults (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
v_head_dim) for configs that leave them out (configuration_deepseek_v2.py / _v3.py, v4.57.1)."""


def _yarn(cfg: dict[str, Any]) -> tuple[float, float, float]:
    """(rotary scaling factor, mscale, mscale_all_dim) of the config's rope_scaling."""
    scaling = cfg.get("rope_scaling") or {}
    if not scaling:
        return 1.0, 1.0, 0.0
    kind = scaling.get("type", scaling.get("rope_type"))
    fixed = {k: scaling.get(k, v) for k, v in YARN_FIXED.items()}
    if kind != "yarn" or fixed != YARN_FIXED:
        raise CaptureError(
            f"rope_scaling {scaling} (Megatron-LM's multi-latent attention takes YaRN scaling "
            "with original_max_position_embeddings 4096, beta_fast 32 and beta_slow 1: "
            "megatron-core fixes them)"
        )
    factor = float(scaling.get("factor", 1.0))
    return factor, float(scaling.get("mscale", 1.0)), float(scaling.get("mscale_all_dim", 0.0))


def latent_attention(cfg: dict[str, Any], kind: str) -> LatentAttention:
    """The multi-latent attention of a deepseek_v2 / deepseek_v3 config."""
    q_lora, kv_lora, nope, rope, v = (
        cfg.get(k, d)
        for k, d in zip(
            ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
            DEFAULT_MLA[kind],
        )
    )
    factor, mscale, mscale_all_dim = _yarn(cfg)
    return LatentAttention(
        multi_latent_attention=True,
        q_lora_rank=q_lora or 0,
        kv_lora_rank=kv_lora,
        qk_head_dim=nope,
        qk_pos_emb_head_dim=rope,
        v_head_dim=v,
        rotary_scaling_factor=factor,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


def mtp_layers(cfg: dict[str, Any]) -> int:
    """Multi-token-prediction layers (num_nextn_predict_layers; absent: none)."""
    return int(cfg.get("num_nextn_predict_layers") or 0)
