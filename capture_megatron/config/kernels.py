"""Kernels: which implementation and fused kernels a run uses, each field with its Megatron-LM flag
and default (core_v0.16.1). What a transformer layer keeps for backward depends on them: flash or
cuDNN-fused attention keep no s x s tensor, the unfused paths do; fused softmax keeps one 16-bit
output; CUDA dropout keeps 1-byte masks. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config.fields import flag
from capture_megatron.errors import require
from capture_megatron.serial import JsonMixin

IMPLEMENTATIONS = ("local", "transformer_engine", "auto")
"""--transformer-impl: Megatron-LM's choices, and auto (capture-megatron training: TE when
importable on CUDA, else the local spec)."""
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
"""--attention-backend choices; auto lets Transformer Engine pick (flash, else cuDNN fused)."""


@dataclass(frozen=True)
class Kernels(JsonMixin):
    """The layer implementation and the fused kernels of a run."""

    transformer_impl: str = flag(
        "--transformer-impl", "transformer_engine", choices=IMPLEMENTATIONS
    )
    """Megatron's local spec or Transformer Engine's modules."""
    attention_backend: str = flag("--attention-backend", "auto", choices=ATTENTION_BACKENDS)
    """Transformer Engine's attention backend (the local spec has its own unfused attention)."""
    attention_softmax_in_fp32: bool = flag("--attention-softmax-in-fp32", False)
    """Compute the unfused attention softmax in fp32."""
    apply_query_key_layer_scaling: bool = flag("--apply-query-key-layer-scaling", False)
    """Scale Q K^T by the layer number (implies the softmax in fp32)."""
    masked_softmax_fusion: bool = flag("--no-masked-softmax-fusion", True, negate=True)
    """The fused scale-mask-softmax kernel (local spec, unfused attention)."""
    bias_gelu_fusion: bool = flag("--no-bias-gelu-fusion", True, negate=True)
    """The fused bias + GeLU."""
    bias_swiglu_fusion: bool = flag("--no-bias-swiglu-fusion", True, negate=True)
    """The fused bias + SwiGLU."""
    bias_dropout_fusion: bool = flag("--no-bias-dropout-fusion", True, negate=True)
    """The fused bias + dropout + residual add."""
    rope_fusion: bool = flag("--no-rope-fusion", True, negate=True)
    """The fused rotary position embedding."""
    cross_entropy_loss_fusion: bool = flag("--cross-entropy-loss-fusion", False)
    """The fused vocabulary-parallel cross entropy."""
    cross_entropy_fusion_impl: str = flag(
        "--cross-entropy-fusion-impl", "native", choices=("native", "te")
    )
    """Which fused cross entropy: Megatron's native one or Transformer Engine's."""
    gradient_accumulation_fusion: bool = flag(
        "--no-gradient-accumulation-fusion", True, negate=True
    )
    """Weight gradients accumulated straight into the fp32 main gradients (needs TE or apex)."""

    def __post_init__(self) -> None:
        p = []
        if self.transformer_impl not in IMPLEMENTATIONS:
            p.append(f"--transformer-impl {self.transformer_impl!r} not one of {IMPLEMENTATIONS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            p.append(
                f"--attention-backend {self.attention_backend!r} not one of {ATTENTION_BACKENDS}"
            )
        require(p, "kernel settings")

    @property
    def softmax_in_fp32(self) -> bool:
        """Whether the unfused softmax runs in fp32 (Megatron: either flag implies it)."""
        return self.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling
