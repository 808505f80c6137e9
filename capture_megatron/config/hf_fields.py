"""How the Hugging Face config fields that are not plain sizes -- the MLP activation, RoPE theta
and scaling -- map onto Megatron-LM's flags (for capture_megatron.config.hf). Pure Python.
"""

from __future__ import annotations

from typing import Any

from capture_megatron.errors import CaptureError

ROPE_THETA = 10000.0
"""Every type's default rope_theta."""
GATED_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu")
"""Activations read as GeGLU (megatron's tanh-approximated GELU; exact 'gelu' keeps the same
tensors)."""
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
"""Llama 3 scaling parameters megatron-core hard-codes (RotaryEmbedding._apply_scaling)."""
LLAMA3_POSITIONS = 8192
"""original_max_position_embeddings megatron-core hard-codes for Llama 3 scaling."""


def activation(cfg: dict[str, Any], kind: str, default: str) -> tuple[str, str]:
    """('swiglu' or 'geglu', note) for the MLP's gate activation (`default`: the type's);
    CaptureError for others.

    transformers' Gemma, Gemma-2 and Gemma-3 MLPs read hidden_activation (Gemma: None means
    gelu_pytorch_tanh, and hidden_act is ignored: v4.46.3 modeling_gemma.py GemmaMLP)."""
    if kind in ("gemma", "gemma2", "gemma3_text"):
        name, field = cfg.get("hidden_activation") or default, "hidden_activation"
        ignored = cfg.get("hidden_act")
        if "hidden_activation" not in cfg and ignored not in (None, name):
            return "geglu", (
                f"hidden_act {ignored!r} is ignored by transformers' {kind} MLP, which uses "
                f"hidden_activation (default {default!r}): read as GeGLU"
            )
    else:
        name, field = cfg.get("hidden_act") or default, "hidden_act"
    if name in ("silu", "swish"):
        return "swiglu", ""
    if name in GATED_GELU:
        note = (
            f"{field} {name!r} is exact GELU; megatron's GeGLU uses the tanh approximation "
            "(same memory)"
            if name == "gelu"
            else ""
        )
        return "geglu", note
    raise CaptureError(
        f"{field} {name!r}: only gated SiLU (SwiGLU) and gated GELU (GeGLU) MLPs are read from "
        "Hugging Face configs"
    )


def rope(cfg: dict[str, Any]) -> tuple[int, bool, float]:
    """(rotary base, Llama 3 scaling on, scaling factor) from rope_theta / rope_scaling (or
    transformers v5's rope_parameters); CaptureError for a scaling Megatron-LM cannot build."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", ROPE_THETA))
    if float(theta) != int(float(theta)):
        raise CaptureError(
            f"rope_theta {theta} is not a whole number: Megatron-LM's --rotary-base is an int"
        )
    scaling = cfg.get("rope_scaling") or params or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return int(float(theta)), False, 8.0
    fixed = {k: float(scaling.get(k, v)) for k, v in LLAMA3_FIXED.items()}
    positions = scaling.get("original_max_position_embeddings", LLAMA3_POSITIONS)
    if kind == "llama3" and fixed == LLAMA3_FIXED and positions == LLAMA3_POSITIONS:
        return int(float(theta)), True, float(scaling.get("factor", 8.0))
    if kind == "llama3":
        why = (
            f"low_freq_factor {fixed['low_freq_factor']:g}, high_freq_factor "
            f"{fixed['high_freq_factor']:g}, original_max_position_embeddings {positions}: "
            "megatron-core's Llama 3 scaling fixes them at 1, 4 and 8192"
        )
    else:
        why = (
            "Megatron-LM's RoPE scaling is Llama 3's (--use-rope-scaling); its "
            "--rotary-seq-len-interpolation-factor never reaches the GPT model in pretrain_gpt.py"
        )
    raise CaptureError(f"rope_scaling type {kind!r} ({why})")
