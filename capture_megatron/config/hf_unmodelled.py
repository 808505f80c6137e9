"""What some Hugging Face model types have that megatron-core's GPT layer (as Megatron-LM's flags
build it) does not: Gemma-2 and Gemma-3 are read (shape and parameter count) but listed field by
field and refused for planning (capture_megatron.config.hf.HfModel.checked); OLMo-2's differences
keep the same tensors and are stated in a note. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA = ("gemma2", "gemma3_text")
"""Types with a norm after each sublayer as well as before it."""
OLMO2_NOTE = (
    "OLMo-2 normalises each sublayer's output (post-norm) and the whole query / key projection; "
    "Megatron-LM's flags build the layer with the norm before each sublayer and --qk-layernorm "
    "per head: the same activations in number and size (one [s, b, h] norm input per sublayer), "
    "{delta:+,} parameters (its q/k norm weights are per projection, not per head); planned as "
    "that layer"
)
"""The note on an OLMo-2 config (format with delta: parameters of the Megatron layer minus
OLMo-2's)."""


@dataclass(frozen=True)
class Unmodelled:
    """A config field megatron-core's GPT model cannot build."""

    field: str
    """The config field (or architecture feature)."""
    why: str
    """What it does that megatron-core's GPT layer does not."""


def gemma_unmodelled(
    cfg: dict[str, Any], kind: str, head_dim: int, seq_length: int, window_default: int | None
) -> tuple[Unmodelled, ...]:
    """What Gemma-2 / Gemma-3 have that megatron-core's GPT layer does not (empty for other
    types): transformers' Gemma2Config / Gemma3TextConfig defaults for absent fields."""
    if kind not in GEMMA:
        return ()
    name = "Gemma-2" if kind == "gemma2" else "Gemma-3"
    found = [
        Unmodelled(
            "post_attention_layernorm and post_feedforward_layernorm",
            f"{name} normalises each sublayer's output too; megatron-core's layer has only the "
            "two input norms",
        )
    ]
    caps = (50.0, 30.0) if kind == "gemma2" else (None, None)
    for (field, what), default in zip(
        (
            ("attn_logit_softcapping", "tanh-caps the attention scores"),
            ("final_logit_softcapping", "tanh-caps the logits before the loss"),
        ),
        caps,
    ):
        value = cfg.get(field, default)
        if value:
            found.append(Unmodelled(f"{field} {value}", f"{what}; megatron-core has no cap"))
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if scalar != head_dim:
        found.append(
            Unmodelled(
                f"query_pre_attn_scalar {scalar}",
                f"scales queries by 1/sqrt({scalar}), not 1/sqrt(head_dim {head_dim}); "
                "Megatron-LM has no flag for the softmax scale",
            )
        )
    width = cfg.get("sliding_window", window_default)
    if width and width < seq_length - 1:
        found.append(_window(cfg, kind, width))
    return tuple(found)


def _window(cfg: dict[str, Any], kind: str, width: int) -> Unmodelled:
    """Gemma's sliding window: on every other layer (Gemma-2), on five of every six layers with
    its own RoPE base (Gemma-3)."""
    if kind == "gemma2":
        return Unmodelled(
            f"sliding_window {width}",
            "a window on every other layer (Megatron-LM's --window-attn-skip-freq, not modelled)",
        )
    pattern = cfg.get("sliding_window_pattern", 6)
    local_base = cfg.get("rope_local_base_freq", 10000)
    return Unmodelled(
        f"sliding_window {width}",
        f"a window on {pattern - 1} of every {pattern} layers, whose RoPE base is "
        f"rope_local_base_freq {local_base} (Megatron-LM's --window-attn-skip-freq, not "
        "modelled; one --rotary-base for all layers)",
    )
