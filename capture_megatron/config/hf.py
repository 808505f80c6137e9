"""Model shapes from a Hugging Face config.json (--hf-config FILE, or a model directory holding
config.json): the decoder-only types llama, mistral, gemma, gemma2, gemma3_text, qwen2, qwen3,
olmo2 and phi3, and with experts mixtral, qwen2_moe, qwen3_moe, deepseek_v2 and deepseek_v3
(capture_megatron.config.hf_moe; DeepSeek's multi-latent attention and multi-token prediction:
capture_megatron.config.hf_latent), each field a config leaves out taken from its type's
transformers default (DEFAULTS, sources cited there).

Read into Megatron's terms: RMSNorm, RoPE (base, Llama 3 scaling), SwiGLU or GeGLU, GQA and
head_dim, tied embeddings, QKV biases (Qwen2's are implicit), query/key norms (--qk-layernorm),
the norm epsilon, a sliding window (Megatron-LM's --window-size when it is shorter than the
sequence), the experts, MLA and MTP. The training precision is bf16 whatever torch_dtype says
(that is how the file's weights are stored). The sequence length is the one given, else
min(max_position_embeddings, 4096), stated in a note. MLP biases or RoPE scalings Megatron-LM
cannot build are an error naming them; Gemma-2 and Gemma-3 are read (their shape and parameter
count are right) but list what megatron-core's GPT layer cannot build, and planning them is
refused (HfModel.checked), never a silent plan of another model; OLMo-2's post-norm layer is
planned as Megatron's pre-norm one with a note (capture_megatron.config.hf_unmodelled).

Gemma also scales the embedding output by sqrt(h) and keeps RMSNorm weights as (1 + w)
(Megatron-LM's --apply-layernorm-1p parameterisation): neither changes a parameter count or the
tensors training keeps, so neither is modelled or emitted. Pure Python.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from capture_megatron.config.hf_count import parameter_count
from capture_megatron.config.hf_fields import activation, rope
from capture_megatron.config.hf_latent import latent_attention, mtp_layers
from capture_megatron.config.hf_moe import MOE_TYPES, experts_of
from capture_megatron.config.hf_unmodelled import GEMMA, OLMO2_NOTE, Unmodelled, gemma_unmodelled
from capture_megatron.config.model import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.features.mla import LatentAttention
from capture_megatron.features.moe import Experts
from capture_megatron.serial import load_json

# Defaults are those of transformers' configuration classes, whose __init__ fills in every field a
# config.json omits: transformers v4.46.3, src/transformers/models/<type>/configuration_<type>.py
# (LlamaConfig, MistralConfig, GemmaConfig, Gemma2Config, Qwen2Config, Phi3Config). The base
# PretrainedConfig's tie_word_embeddings default is True (configuration_utils.py:
# kwargs.pop("tie_word_embeddings", True)), but each of these types passes its own default up:
# False for llama, mistral, qwen2, phi3; True for gemma, gemma2. transformers main (commit
# 008e5743, v5) declares the same defaults as dataclass fields.


@dataclass(frozen=True)
class TypeDefaults:
    """transformers' defaults of one model type, for the fields capture-megatron reads."""

    tie_word_embeddings: bool
    """Output layer shares the embedding's weights."""
    hidden_act: str
    """The MLP's gate activation (Gemma and Gemma-2 read hidden_activation instead)."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    max_position_embeddings: int
    """Positions the model was built for."""
    intermediate_size: int
    """MLP width."""
    num_key_value_heads: int | None
    """Key/value heads (None: one per attention head)."""
    head_dim: int | None
    """Per-head width (None: hidden / heads)."""
    sliding_window: int | None
    """Sliding-window attention width (None: full attention)."""


DEFAULTS = {
    "llama": TypeDefaults(False, "silu", 1e-6, 2048, 11008, None, None, None),
    "mistral": TypeDefaults(False, "silu", 1e-6, 4096 * 32, 14336, 8, None, 4096),
    "gemma": TypeDefaults(True, "gelu_pytorch_tanh", 1e-6, 8192, 24576, 16, 256, None),
    "gemma2": TypeDefaults(True, "gelu_pytorch_tanh", 1e-6, 8192, 9216, 4, 256, 4096),
    "qwen2": TypeDefaults(False, "silu", 1e-6, 32768, 22016, 32, None, 4096),
    "phi3": TypeDefaults(False, "silu", 1e-5, 4096, 8192, None, None, None),
    # transformers v4.57.1's configuration_<type>.py for the types with experts
    "mixtral": TypeDefaults(False, "silu", 1e-5, 4096 * 32, 14336, 8, None, None),
    "qwen2_moe": TypeDefaults(False, "silu", 1e-6, 32768, 5632, 16, None, 4096),
    "qwen3_moe": TypeDefaults(False, "silu", 1e-6, 32768, 6144, 4, None, 4096),
    "deepseek_v2": TypeDefaults(False, "silu", 1e-6, 2048, 11008, None, None, None),
    "deepseek_v3": TypeDefaults(False, "silu", 1e-6, 4096, 18432, 128, None, None),
    # transformers main (commit 008e5743) Qwen3Config / Olmo2Config; commit 008f5c8c
    # Gemma3TextConfig (tie_word_embeddings True, hidden_activation gelu_pytorch_tanh)
    "qwen3": TypeDefaults(False, "silu", 1e-6, 32768, 22016, 32, 128, 4096),
    "olmo2": TypeDefaults(False, "silu", 1e-5, 2048, 11008, None, None, None),
    "gemma3_text": TypeDefaults(True, "gelu_pytorch_tanh", 1e-6, 131072, 9216, 4, 256, 4096),
}
"""transformers v4.46.3's defaults per model_type (the comment above names the files). Phi-3
fuses q, k, v into qkv_proj and gate, up into gate_up_proj: the same parameters as Megatron's
linear_qkv and linear_fc1. Qwen2's sliding window only applies with use_sliding_window (default
false)."""
QK_NORM = ("qwen3", "qwen3_moe", "olmo2", "gemma3_text", "deepseek_v2", "deepseek_v3")
"""Types that normalise queries and keys (q_norm / k_norm; DeepSeek's query and key-value latents'
q_a_layernorm / kv_a_layernorm): Megatron-LM's --qk-layernorm."""
MODEL_TYPES = tuple(DEFAULTS)
"""HF model types read from config.json (decoder-only; those of hf_moe.MOE_TYPES with
experts)."""
DEFAULT_SEQ_LENGTH = 4096
"""Sequence length when --seq-length is not given (at most the config's positions)."""
_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
_REFUSED = {
    "mlp_bias": "MLP biases without the other linear biases have no Megatron-LM flag",
}
"""Config fields that change memory in ways not modelled, with the reason (when set, non-zero)."""
_O_PROJ_BIAS = (
    *("llama", "gemma", "gemma2", "gemma3_text", "qwen3", "qwen3_moe", "olmo2"),
    *("deepseek_v2", "deepseek_v3"),
)
"""Types whose attention_bias also puts a bias on o_proj (Megatron-LM: QKV only, or all)."""


@dataclass(frozen=True)
class HfModel:
    """A config.json read: the model in Megatron's terms, what the user should be told about the
    reading, and the fields megatron-core's GPT spec cannot build (planning refuses while any
    remain)."""

    path: str
    """The config.json read."""
    shape: ModelShape
    """The model as megatron-core builds it (every field of the config that it can build)."""
    notes: tuple[str, ...] = ()
    """What was assumed or chosen (default sequence length, window, precision), for the CLI."""
    unmodelled: tuple[Unmodelled, ...] = ()
    """Fields read but not buildable by megatron-core's GPT layer."""

    def checked(self) -> HfModel:
        """This model, or a CaptureError naming each unmodelled field and why."""
        if not self.unmodelled:
            return self
        parts = "; ".join(f"{u.field} ({u.why})" for u in self.unmodelled)
        raise CaptureError(
            f"--hf-config {self.path} is read ({parameter_count(self.shape) / 1e9:.2f}B "
            f"parameters) but megatron-core's GPT layer cannot build it: {parts}. Planning it as "
            "the model megatron-core can build would plan a different model; nothing is planned."
        )


def _config_path(path: str) -> str:
    """`path`, or the config.json inside it when it is a directory."""
    if not os.path.isdir(path):
        return path
    inner = os.path.join(path, "config.json")
    if not os.path.isfile(inner):
        raise CaptureError(f"--hf-config {path} is a directory without a config.json")
    return inner


def _load(path: str) -> dict[str, Any]:
    """The config's JSON object, its required sizes checked and its model type known."""
    cfg = load_json(path, f"--hf-config {path}")
    if not isinstance(cfg, dict):
        raise CaptureError(f"--hf-config {path} does not hold a JSON object")
    missing = [k for k in _HF_REQUIRED if not isinstance(cfg.get(k), int)]
    if missing:
        raise CaptureError(
            f"--hf-config {path} lacks integer fields {missing} (model_type "
            f"{cfg.get('model_type', '?')!r}); Llama, Mistral, Gemma, Qwen2 and Phi-3 configs "
            "have them"
        )
    refused = [f"{k} {cfg[k]!r} ({why})" for k, why in _REFUSED.items() if cfg.get(k)]
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        refused.insert(0, f"model_type {kind!r} (read: {', '.join(MODEL_TYPES)})")
    if kind in _O_PROJ_BIAS and cfg.get("attention_bias"):
        refused.append(
            "attention_bias true (biases on q, k, v and o_proj: Megatron-LM has QKV-only "
            "(--add-qkv-bias) or all linear biases, not this set)"
        )
    if refused:
        raise CaptureError(
            f"--hf-config {path} describes a model capture-megatron does not model yet: "
            + "; ".join(refused)
            + ". Planning it without them would plan another model; give a config of one of "
            "those types, or the model's flags without these features."
        )
    return cfg


def read_hf_config(path: str, seq_length: int | None = None, dtype: str | None = None) -> HfModel:
    """The model a config.json (or a directory holding one) describes, at `seq_length` (None: the
    stated default) trained in `dtype` (None: bf16, stated when the file stores another type);
    CaptureError for what cannot be read as a megatron-core GPT model."""
    path = _config_path(path)
    try:
        return _read(path, _load(path), seq_length, dtype)
    except CaptureError as err:
        if str(err).startswith("--hf-config"):
            raise
        raise CaptureError(f"--hf-config {path}: {err}") from None


def _read(path: str, cfg: dict[str, Any], seq_length: int | None, dtype: str | None) -> HfModel:
    kind: str = cfg["model_type"]
    base = DEFAULTS[kind]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    positions = cfg.get("max_position_embeddings") or base.max_position_embeddings
    seq, notes = _sequence(positions, seq_length)
    gate, act_note = activation(cfg, kind, base.hidden_act)
    latent = latent_attention(cfg, kind) if kind.startswith("deepseek") else LatentAttention()
    head_dim = cfg.get("head_dim") or base.head_dim or hidden // heads
    head_dim = latent.v_head_dim if latent.enabled else head_dim  # --kv-channels, as NVIDIA's
    plain = {k: v for k, v in cfg.items() if k != "rope_scaling"}  # MLA's YaRN: hf_latent
    rotary_base, scaling, factor = rope(plain if latent.enabled else cfg)
    groups = cfg.get("num_key_value_heads") or base.num_key_value_heads or heads
    window, window_note = _window(cfg, kind, seq)
    shape = ModelShape(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg.get("intermediate_size") or base.intermediate_size,
        num_query_groups=groups if groups != heads else 0,
        kv_channels=head_dim if head_dim * heads != hidden else 0,
        max_position_embeddings=positions,
        swiglu=gate == "swiglu",
        geglu=gate == "geglu",
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=not cfg.get(
            "tie_word_embeddings", base.tie_word_embeddings
        ),
        position_embedding_type="rope",
        add_bias_linear=False,
        # Qwen2Attention: q/k/v_proj bias=True, o_proj none; Qwen2-MoE: its qkv_bias
        add_qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and cfg.get("qkv_bias", True)),
        norm_epsilon=float(cfg.get("rms_norm_eps") or base.rms_norm_eps),
        rotary_base=rotary_base,
        use_rope_scaling=scaling,
        rope_scaling_factor=factor,
        window_size=window,
        hidden_dropout=_hidden_dropout(cfg),
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        dtype=dtype or "bf16",
        moe=experts_of(cfg, kind) if kind in MOE_TYPES else Experts(),
        qk_layernorm=kind in QK_NORM,
        mla=latent,
        mtp_num_layers=mtp_layers(cfg),
    )
    stored = "" if dtype else _precision_note(cfg)
    notes += tuple(n for n in (act_note, window_note, stored) if n)
    if kind == "olmo2":
        olmo = parameter_count(shape) - _olmo2_parameters(shape)
        notes += (OLMO2_NOTE.format(delta=olmo),)
    unmodelled = gemma_unmodelled(cfg, kind, head_dim, seq, base.sliding_window)
    return HfModel(path, shape, notes, unmodelled)


def _olmo2_parameters(shape: ModelShape) -> int:
    """OLMo-2's own parameter count: per layer a norm after each sublayer (h each) and RMSNorms
    over the whole query and key projections, where Megatron's layer has two input norms and
    per-head query / key norms."""
    d, heads, groups = shape.head_dim, shape.num_attention_heads, shape.groups
    return parameter_count(shape) - shape.num_layers * (2 * d - (heads + groups) * d)


def _sequence(positions: int, seq_length: int | None) -> tuple[int, tuple[str, ...]]:
    """The sequence length and its note; CaptureError when longer than the positions."""
    if seq_length is not None and seq_length > positions:
        raise CaptureError(
            f"--seq-length {seq_length} is longer than the {positions} positions the model has "
            f"(max_position_embeddings {positions}); give --seq-length {positions} or less"
        )
    if seq_length is not None:
        return seq_length, ()
    seq = min(positions, DEFAULT_SEQ_LENGTH)
    return seq, (
        f"sequence length {seq} (default; the config allows {positions} positions; give "
        "--seq-length)",
    )


def _window(cfg: dict[str, Any], kind: str, seq: int) -> tuple[tuple[int, ...], str]:
    """Megatron-LM's --window-size (left, right) for the config's sliding window at sequence
    length `seq` (empty when there is none, or when no token falls outside it), and a note."""
    width = cfg.get("sliding_window", DEFAULTS[kind].sliding_window)
    if kind in ("llama", "gemma", *GEMMA) or not width:  # gemma2, gemma3: gemma_unmodelled
        return (), ""
    if kind in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if not cfg.get("use_sliding_window", False):
            return (), ""
        layers, first = cfg["num_hidden_layers"], cfg.get("max_window_layers", 28)
        if first >= layers:
            return (), ""
        if first > 0:
            raise CaptureError(
                f"use_sliding_window with max_window_layers {first} (a window on layers "
                f"{first}..{layers - 1} only: Megatron-LM's --window-size applies to every layer)"
            )
    if width >= seq - 1:
        return (), f"sliding_window {width} covers the sequence {seq}: no window is needed"
    return (int(width), 0), (
        f"sliding_window {width} is read as --window-size {width},0: under flash or cuDNN fused "
        "attention (the GPU kernel set) it changes no memory; on the cpu kernel set the local "
        "spec's unfused softmax builds its mask, which the profiler measures"
    )


def _hidden_dropout(cfg: dict[str, Any]) -> float:
    """Phi-3's resid_pdrop (= embd_pdrop: Megatron's one hidden dropout does both); else 0."""
    resid, embd = (float(cfg.get(k) or 0.0) for k in ("resid_pdrop", "embd_pdrop"))
    if resid != embd:
        raise CaptureError(
            f"resid_pdrop {resid} and embd_pdrop {embd} differ: Megatron-LM's --hidden-dropout "
            "is both"
        )
    return resid


def _precision_note(cfg: dict[str, Any]) -> str:
    """Why the training precision is bf16 when the file stores its weights otherwise."""
    stored = cfg.get("torch_dtype") or cfg.get("dtype")
    if stored in (None, "bfloat16"):
        return ""
    return (
        f"training precision bf16 (the default; torch_dtype {stored} is how the file stores its "
        "weights); give --fp16 for fp16"
    )


def from_hf_config(path: str, seq_length: int | None = None) -> ModelShape:
    """ModelShape (bf16) of a config.json (or a directory holding one) that megatron-core can
    build; CaptureError naming any field that is not modelled."""
    return read_hf_config(path, seq_length).checked().shape
