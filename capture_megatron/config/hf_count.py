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


def _norm(shape: Any) -> int:
    """Parameters per normalised element: weight (RMSNorm), or weight and bias (LayerNorm)."""
    return 2 if shape.normalization == "LayerNorm" else 1


def _latent_attention(shape: Any) -> int:
    """Parameters of one multi-latent attention (biases when --disable-bias-linear is absent)."""
    h, heads, mla = shape.hidden_size, shape.num_attention_heads, shape.mla
    q_width = heads * mla.q_head_dim
    pairs = [(h, mla.kv_lora_rank + mla.qk_pos_emb_head_dim)]  # linear_kv_down_proj
    pairs.append((mla.kv_lora_rank, heads * (mla.qk_head_dim + mla.v_head_dim)))  # kv up
    pairs.append((heads * mla.v_head_dim, h))  # linear_proj
    if mla.q_lora_rank:
        pairs += [(h, mla.q_lora_rank), (mla.q_lora_rank, q_width)]  # q down, q up
    else:
        pairs.append((h, q_width))  # linear_q_proj
    total = sum(i * o + (o if shape.add_bias_linear else 0) for i, o in pairs)
    if shape.qk_layernorm:  # q_layernorm (with a query latent) and kv_layernorm
        total += _norm(shape) * (mla.kv_lora_rank + mla.q_lora_rank)
    return total


def _attention(shape: Any) -> int:
    """Parameters of one layer's attention, its query/key norms included."""
    if shape.mla.enabled:
        return _latent_attention(shape)
    h, d, heads = shape.hidden_size, shape.head_dim, shape.num_attention_heads
    qkv = (heads + 2 * shape.groups) * d
    total = h * qkv + heads * d * h
    total += qkv if shape.add_bias_linear or shape.add_qkv_bias else 0
    total += h if shape.add_bias_linear else 0
    if shape.qk_layernorm:
        total += _norm(shape) * 2 * d
    return total


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
