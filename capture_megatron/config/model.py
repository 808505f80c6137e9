"""ModelShape: a GPT model's architecture in Megatron's terms, each field with its Megatron flag.

Frozen, validated at construction (a CaptureError naming every offending factor), round-tripped
exactly through JSON. Pure Python: no torch import here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from capture_megatron.errors import CaptureError, require
from capture_megatron.features.mla import LatentAttention
from capture_megatron.features.moe import Experts
from capture_megatron.fields import flag, value_problems
from capture_megatron.serial import JsonMixin

GIB = 1 << 30
"""Bytes in a GiB."""
DTYPES = ("fp32", "bf16", "fp16")
"""Training precisions (--bf16 / --fp16; fp32 without either)."""
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""Megatron's --normalization choices."""
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
"""Megatron's --position-embedding-type choices this project supports."""
MEGATRON_POSITION_EMBEDDINGS = (*POSITION_EMBEDDINGS, "mrope", "relative", "none")
"""Every --position-embedding-type Megatron-LM accepts (core_v0.16.1); the others are refused as
not modelled, not as invalid."""


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a ModelShape dtype name."""
    return 4 if dtype == "fp32" else 2


@dataclass(frozen=True)
class ModelShape(JsonMixin):
    """A GPT model's architecture, in Megatron's terms."""

    num_layers: int = flag("--num-layers")
    """Transformer (decoder) layers."""
    hidden_size: int = flag("--hidden-size")
    """Model width h."""
    num_attention_heads: int = flag("--num-attention-heads")
    """Attention heads a."""
    seq_length: int = flag("--seq-length")
    """Training sequence length s."""
    vocab_size: int = flag("--vocab-size", note="(default: the tokenizer's)")
    """Tokenizer vocabulary before Megatron's padding."""
    ffn_hidden_size: int = flag("--ffn-hidden-size", 0)
    """MLP width; 0 means Megatron's default 4h."""
    num_query_groups: int = flag("--num-query-groups", 0, note="(with --group-query-attention)")
    """Key/value groups for GQA; 0 means one per head (plain MHA)."""
    kv_channels: int = flag("--kv-channels", 0)
    """Per-head width; 0 means h / a."""
    max_position_embeddings: int = flag("--max-position-embeddings", 0)
    """Learned position table size; 0 means seq_length."""
    make_vocab_size_divisible_by: int = flag("--make-vocab-size-divisible-by", 128)
    """Megatron pads the vocabulary to a multiple of this times TP."""
    swiglu: bool = flag("--swiglu", False)
    """Gated SiLU MLP."""
    geglu: bool = flag(
        "--geglu",
        False,
        note="(capture-megatron: stock Megatron-LM's pretrain_gpt.py has no flag for it)",
    )
    """Gated tanh-GELU MLP (GeGLU, Gemma's): megatron-core's gated_linear_unit with GELU."""
    normalization: str = flag("--normalization", "LayerNorm", choices=NORMALIZATIONS)
    """LayerNorm or RMSNorm."""
    untie_embeddings_and_output_weights: bool = flag("--untie-embeddings-and-output-weights", False)
    """Separate output layer weights."""
    position_embedding_type: str = flag(
        "--position-embedding-type", "learned_absolute", choices=MEGATRON_POSITION_EMBEDDINGS
    )
    """learned_absolute or rope."""
    add_bias_linear: bool = flag("--disable-bias-linear", True, negate=True)
    """Biases in linear layers (off with --disable-bias-linear)."""
    add_qkv_bias: bool = flag("--add-qkv-bias", False)
    """Biases in the QKV projection only (Qwen2's; implied by linear biases)."""
    norm_epsilon: float = flag("--norm-epsilon", 1e-5)
    """Epsilon of the LayerNorm / RMSNorm."""
    rotary_base: int = flag("--rotary-base", 10000)
    """RoPE base (theta)."""
    use_rope_scaling: bool = flag("--use-rope-scaling", False)
    """Llama 3.x RoPE frequency scaling (low / high frequency factors 1 / 4, original 8192
    positions)."""
    rope_scaling_factor: float = flag("--rope-scaling-factor", 8.0)
    """Llama 3.x RoPE scaling factor."""
    window_size: tuple[int, ...] = flag("--window-size", (), sep=",", note="(e.g. 4096,0)")
    """Sliding-window attention: (left, right) tokens each query sees; empty: full causal."""
    qk_layernorm: bool = flag("--qk-layernorm", False)
    """A norm (--normalization) on each query and key head before the attention core (Qwen3,
    OLMo-2, Gemma-3, DeepSeek-V3's MLA latents)."""
    qk_l2_norm: bool = flag("--qk-l2-norm", False)
    """An L2 norm (no weights) on each query and key head before the attention core."""
    mtp_num_layers: int = flag("--mtp-num-layers", 0, note="(absent or 0: none)")
    """Multi-token prediction layers after the decoder (on the last pipeline stage, as Megatron
    places them); 0 means none."""
    hidden_dropout: float = flag("--hidden-dropout", 0.1)
    """Dropout after attention and MLP."""
    attention_dropout: float = flag("--attention-dropout", 0.1)
    """Dropout on attention probabilities."""
    dtype: str = "fp32"
    """Parameter/activation precision: fp32, bf16 (--bf16) or fp16 (--fp16)."""
    moe: Experts = Experts()
    """Mixture-of-experts layers (Megatron's MoE flags; none by default)."""
    mla: LatentAttention = LatentAttention()
    """Multi-latent attention (Megatron's MLA flags; off by default)."""

    def __post_init__(self) -> None:
        require(self._problems(), "model shape")

    def _problems(self) -> list[str]:
        p: list[str] = value_problems(self)  # types, finite, not negative (config.fields)
        if p:
            return p
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                p.append(f"{name} {getattr(self, name)} must be positive")
        heads, hidden = self.num_attention_heads, self.hidden_size
        if heads > 0 and self.kv_channels == 0 and hidden % heads:
            p.append(f"hidden {hidden} not divisible by heads {heads} (set --kv-channels)")
        if self.num_query_groups and heads % self.num_query_groups:
            p.append(f"heads {heads} not divisible by query groups {self.num_query_groups}")
        if self.dtype not in DTYPES:
            p.append(f"dtype {self.dtype!r} not one of {DTYPES}")
        if self.normalization not in NORMALIZATIONS:
            p.append(f"normalization {self.normalization!r} not one of {NORMALIZATIONS}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            p.append(
                f"--position-embedding-type {self.position_embedding_type} is not modelled "
                f"(modelled: {', '.join(POSITION_EMBEDDINGS)})"
            )
        if (
            self.max_position_embeddings
            and self.position_embedding_type == "learned_absolute"
            and self.max_position_embeddings < self.seq_length
        ):
            p.append(
                f"max_position_embeddings {self.max_position_embeddings} < seq_length "
                f"{self.seq_length}"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"{name} {getattr(self, name)} not in [0, 1)")
        return p + self._feature_problems()

    def _feature_problems(self) -> list[str]:
        p: list[str] = []
        if self.swiglu and self.geglu:
            p.append("--swiglu and --geglu are two MLP activations: give one")
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            p.append("--use-rope-scaling needs --position-embedding-type rope")
        if self.rotary_base < 1 or self.rope_scaling_factor <= 0 or self.norm_epsilon <= 0:
            p.append(
                f"--rotary-base {self.rotary_base}, --rope-scaling-factor "
                f"{self.rope_scaling_factor} and --norm-epsilon {self.norm_epsilon} must be "
                "positive"
            )
        window = self.window_size
        if window and (len(window) != 2 or min(window) < -1):
            p.append(f"--window-size {window} must be two counts (left,right), -1 for unbounded")
        if self.mtp_num_layers < 0:
            p.append(f"--mtp-num-layers {self.mtp_num_layers} must be >= 0")
        if self.qk_layernorm and self.qk_l2_norm:
            p.append("--qk-layernorm and --qk-l2-norm are two query/key norms: give one")
        return p + self._latent_problems() + self._moe_problems()

    def _latent_problems(self) -> list[str]:
        """What megatron-core 0.16.1 refuses of multi-latent attention (Megatron-LM's asserts)."""
        if not self.mla.enabled:
            return []
        p = []
        if self.num_query_groups and self.num_query_groups != self.num_attention_heads:
            p.append(
                "--multi-latent-attention with --group-query-attention: Megatron-LM makes them "
                "mutually exclusive"
            )
        if self.qk_l2_norm:
            p.append("--qk-l2-norm is not supported with multi-latent attention (megatron-core)")
        return p

    def _moe_problems(self) -> list[str]:
        if not self.moe.enabled:
            return []
        try:
            self.moe.pattern(self.num_layers)
        except CaptureError as err:
            return [str(err)]
        return []

    @property
    def qk_norm(self) -> str:
        """The norm on each query and key head: 'layernorm' (--qk-layernorm: --normalization's
        kind; with MLA the norms of the query and key/value latents), 'l2' (--qk-l2-norm) or ''."""
        return "layernorm" if self.qk_layernorm else ("l2" if self.qk_l2_norm else "")

    @property
    def ffn(self) -> int:
        """MLP width with Megatron's default applied."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn(self) -> int:
        """A routed expert's MLP width (Megatron's default: --ffn-hidden-size)."""
        return self.moe.ffn(self.ffn)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per transformer layer, whether it is an MoE layer."""
        return self.moe.pattern(self.num_layers)

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (SwiGLU or GeGLU: fc1 is twice as wide)."""
        return self.swiglu or self.geglu

    @property
    def groups(self) -> int:
        """Key/value groups with the MHA default applied."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Per-head width with the h / a default applied."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        """Position table size with the seq_length default applied."""
        return self.max_position_embeddings or self.seq_length

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary padded as Megatron does: to a multiple of make_vocab_size_divisible_by *
        tp."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def replace(self, **changes: Any) -> ModelShape:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def tp_head_problems(heads: int, groups: int, tp: int) -> list[str]:
    """The one place of the rule "TP divides the attention heads and the query groups" (Megatron
    gives every tensor-parallel rank whole heads and whole key/value groups): one problem per count
    `tp` does not divide (empty: TP splits the attention)."""
    counts = (("heads", heads), ("query groups", groups))
    return [f"{name} {n} not divisible by TP {tp}" for name, n in counts if tp >= 1 and n % tp]
