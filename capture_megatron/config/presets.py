"""Model shapes by name (--preset). Pure Python.

GPT-3 sizes follow Brown et al. 2020, Table 2.1 (seq 2048, GPT-2 vocabulary 50257, learned
positions, GeLU MLP 4h, LayerNorm, tied embeddings); Llama-2 (Touvron et al. 2023) and Llama-3 (Meta
2024) use RMSNorm, SwiGLU, RoPE, no biases, untied output layer, and GQA where the model has it. All
presets train in bf16 (--bf16); flags given on the command line override preset values."""

from __future__ import annotations

from capture_megatron.config.model import ModelShape
from capture_megatron.errors import CaptureError


def _gpt3(layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=2048,
        vocab_size=50257,
        dtype="bf16",
    )


def _llama(
    layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int, seq: int
) -> ModelShape:
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=vocab,
        ffn_hidden_size=ffn,
        num_query_groups=groups if groups != heads else 0,
        swiglu=True,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        dtype="bf16",
    )


PRESETS: dict[str, ModelShape] = {
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192),
}
"""Named model shapes for --preset."""


def preset(name: str) -> ModelShape:
    """The named preset, or a CaptureError listing the names."""
    if name not in PRESETS:
        raise CaptureError(f"--preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
