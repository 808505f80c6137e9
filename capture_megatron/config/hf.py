"""Model shapes from a Hugging Face config.json (--hf-config): Llama, Mistral and Qwen2 style. Pure
Python."""

from __future__ import annotations

from capture_megatron.config.model import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.serial import load_json

_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def from_hf_config(path: str, seq_length: int | None = None) -> ModelShape:
    """ModelShape of a Llama / Mistral / Qwen2-style Hugging Face config.json."""
    cfg = load_json(path, f"--hf-config {path}")
    if not isinstance(cfg, dict):
        raise CaptureError(f"--hf-config {path} does not hold a JSON object")
    missing = [k for k in _HF_REQUIRED if not isinstance(cfg.get(k), int)]
    if missing:
        raise CaptureError(
            f"--hf-config {path} lacks integer fields {missing} (model_type "
            f"{cfg.get('model_type', '?')!r}); Llama, Mistral and Qwen2 configs have them"
        )
    act = cfg.get("hidden_act", "silu")
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    positions = cfg.get("max_position_embeddings", 4096)
    head_dim = cfg.get("head_dim") or 0
    return ModelShape(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        seq_length=seq_length or min(positions, 4096),
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg.get("intermediate_size", 0),
        num_query_groups=groups if groups != heads else 0,
        kv_channels=head_dim if head_dim and head_dim * heads != cfg["hidden_size"] else 0,
        max_position_embeddings=positions,
        swiglu=act in ("silu", "swish"),
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        position_embedding_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        dtype="bf16" if cfg.get("torch_dtype", "bfloat16") in ("bfloat16", "float16") else "fp32",
    )
