"""Which attention core the GPU kernel set builds for Megatron-LM's flags.

- transformer_impl local, or --attention-backend local: megatron's own DotProductAttention (its
  fused softmax comes from capture_megatron.emulate.gpu.softmax);
- auto / fused: TE's FusedAttention (cuDNN), what TE picks on Hopper for bf16 / fp16 causal
  attention (gpu.attention.FusedCoreAttention);
- flash: TE's FlashAttention with flash-attn 2 (gpu.attention.FlashCoreAttention);
- unfused: TE's UnfusedDotProductAttention (gpu.unfused.UnfusedCoreAttention).
"""

from __future__ import annotations

from capture_megatron.config import Kernels


def core_attention(kernels: Kernels):
    """The core_attention module class for the kernels (see the module docstring)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from capture_megatron.emulate.gpu.attention import FlashCoreAttention, FusedCoreAttention

    if kernels.transformer_impl == "local" or kernels.attention_backend == "local":
        return DotProductAttention
    if kernels.attention_backend == "unfused":
        from capture_megatron.emulate.gpu.unfused import UnfusedCoreAttention

        return UnfusedCoreAttention
    if kernels.attention_backend == "flash":
        return FlashCoreAttention
    return FusedCoreAttention
