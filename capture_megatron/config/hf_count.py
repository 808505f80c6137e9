"""Parameters of the GPT model megatron-core builds for a ModelShape (core_v0.16.1), with the
unpadded vocabulary: what a published count (model card, safetensors total) is checked against.

Per transformer layer: the attention (standard: QKV and output projections; multi-latent: the
query / key-value down and up projections and the output projection,
megatron/core/transformer/multi_latent_attention.py), the query/key norms of --qk-layernorm (per
head; with MLA the norms of the query and key-value latents), the MLP or the experts
(capture_megatron.config.hf_moe) and two norms. Then the embedding (and output layer when
untied), a learned position table, the final norm, and each multi-token-prediction layer
(megatron/core/transformer/multi_token_prediction.py: its two input norms, the 2h -> h
projection, one transformer layer built like the decoder's last, and a final norm; embedding and
output layer shared). Pure Python.
"""

from __future__ import annotations

from typing import Any

from capture_megatron.config.hf_moe import expert_parameters
from capture_megatron.features.mla import attention_parameters


def _norm(shape: Any) -> int:
    """Parameters per normalised element: weight (RMSNorm), or weight and bias (LayerNorm)."""
    return 2 if shape.normalization == "LayerNorm" else 1


def _attention(shape: Any) -> int:
    """Parameters of one layer's attention, its query/key (or latent) norms included."""
    return attention_parameters(shape)


def _dense_mlp(shape: Any) -> int:
    """Parameters of a dense layer's MLP."""
    h, f, gate = shape.hidden_size, shape.ffn, 2 if shape.gated else 1
    return gate * h * f + f * h + ((gate * f + h) if shape.add_bias_linear else 0)


def parameter_count(shape: Any) -> int:
    """Parameters of the model megatron-core builds for `shape` (a ModelShape), with the
    unpadded vocabulary (Megatron's padding adds rows; see ModelShape.padded_vocab)."""
    h, norm = shape.hidden_size, _norm(shape)
    layer = _attention(shape) + _dense_mlp(shape) + 2 * norm * h
    moe_layers = shape.moe_layers if shape.moe.enabled else (False,) * shape.num_layers
    moe_mlp, dense_mlp = expert_parameters(shape) if shape.moe.enabled else (0, 0)
    extra = moe_mlp - dense_mlp  # an MoE layer's MLP over a dense one's
    vocab = shape.vocab_size * h * (2 if shape.untie_embeddings_and_output_weights else 1)
    learned = shape.max_positions * h if shape.position_embedding_type != "rope" else 0
    decoder = shape.num_layers * layer + sum(moe_layers) * extra
    last = layer + (extra if moe_layers[-1] else 0)
    mtp = shape.mtp_num_layers * (last + 3 * norm * h + 2 * h * h)
    return decoder + vocab + learned + norm * h + mtp
