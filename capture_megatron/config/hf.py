"""Model shapes from a Hugging Face config.json (--hf-config): Llama and Mistral style (dense, RoPE,
RMSNorm, SwiGLU, no biases). Fields that describe what is not modelled yet -- experts, multi-latent
attention, QKV or MLP biases, a sliding window shorter than the sequence, other model types -- are
an error naming them, never a silent dense plan. Pure Python."""

from __future__ import annotations

from capture_megatron.config.model import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.serial import load_json

_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
MODEL_TYPES = ("llama", "mistral")
"""HF model types whose configs map onto a megatron-core GPT model exactly."""
_MOE = "mixture of experts is not modelled yet"
_MLA = "multi-latent attention is not modelled yet"
_UNMODELLED = {
    "num_local_experts": _MOE,
    "num_experts": _MOE,
    "n_routed_experts": _MOE,
    "n_shared_experts": _MOE,
    "moe_intermediate_size": _MOE,
    "num_experts_per_tok": _MOE,
    "shared_expert_intermediate_size": _MOE,
    "kv_lora_rank": _MLA,
    "q_lora_rank": _MLA,
    "qk_rope_head_dim": _MLA,
    "attention_bias": "QKV biases (--add-qkv-bias) are not modelled yet",
    "mlp_bias": "MLP biases with RMSNorm models are not modelled yet",
}
"""Config fields that change memory in ways not modelled, with the reason (when set, non-zero)."""
_QWEN2 = "qwen2 adds QKV biases (--add-qkv-bias), which are not modelled yet"


def _unmodelled(cfg: dict, seq_length: int) -> list[str]:
    """'field value (reason)' for every field of cfg that is not modelled."""
    found = [f"{k} {cfg[k]!r} ({why})" for k, why in _UNMODELLED.items() if cfg.get(k)]
    kind = cfg.get("model_type")
    if kind is not None and kind not in MODEL_TYPES:
        why = _QWEN2 if kind == "qwen2" else f"supported model types: {', '.join(MODEL_TYPES)}"
        found.insert(0, f"model_type {kind!r} ({why})")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        found.append(f"hidden_act {act!r} (only SiLU-gated MLPs (SwiGLU) are read from HF configs)")
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window < seq_length and cfg.get("use_sliding_window", True):
        found.append(
            f"sliding_window {window} (shorter than the sequence {seq_length}; window "
            "attention is not modelled yet)"
        )
    return found


def from_hf_config(path: str, seq_length: int | None = None) -> ModelShape:
    """ModelShape of a Llama / Mistral-style Hugging Face config.json; CaptureError naming any
    field that is not modelled."""
    cfg = load_json(path, f"--hf-config {path}")
    if not isinstance(cfg, dict):
        raise CaptureError(f"--hf-config {path} does not hold a JSON object")
    missing = [k for k in _HF_REQUIRED if not isinstance(cfg.get(k), int)]
    if missing:
        raise CaptureError(
            f"--hf-config {path} lacks integer fields {missing} (model_type "
            f"{cfg.get('model_type', '?')!r}); Llama, Mistral and Qwen2 configs have them"
        )
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    positions = cfg.get("max_position_embeddings", 4096)
    seq = seq_length or min(positions, 4096)
    refused = _unmodelled(cfg, seq)
    if refused:
        raise CaptureError(
            f"--hf-config {path} describes a model capture-megatron does not model yet: "
            + "; ".join(refused)
            + ". Planning it as a dense model would give a wrong plan; give a dense Llama or "
            "Mistral style config, or the model's flags without these features."
        )
    head_dim = cfg.get("head_dim") or 0
    return ModelShape(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg.get("intermediate_size", 0),
        num_query_groups=groups if groups != heads else 0,
        kv_channels=head_dim if head_dim and head_dim * heads != cfg["hidden_size"] else 0,
        max_position_embeddings=positions,
        swiglu=True,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        position_embedding_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        dtype="bf16" if cfg.get("torch_dtype", "bfloat16") in ("bfloat16", "float16") else "fp32",
    )
