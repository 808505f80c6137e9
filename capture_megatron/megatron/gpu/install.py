"""Put the GPU kernel modules where megatron-core looks for the real kernels (fake-cuda only).

- sys.modules['scaled_upper_triang_masked_softmax_cuda' | 'scaled_masked_softmax_cuda' |
  'scaled_softmax_cuda']: imported inside megatron/core/fusions/fused_softmax.py's autograd
  Functions when config.masked_softmax_fusion and the kernel's shape conditions hold;
- megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb: megatron's hook
  for Transformer Engine's fused RoPE (config.apply_rope_fusion);
- megatron.core.fusions.fused_cross_entropy.calculate_gradients: with the buffer its compiled
  form allocates (capture_megatron.megatron.gpu.compiled);
- apex's fused_weight_gradient_mlp_cuda and TE's get_dummy_wgrad in megatron's linear layers,
  and TE's duplicated Linear where megatron's MLA module looks for TELinear
  (capture_megatron.megatron.gpu.linear);
- the Triton kernels of megatron's fused MLA RoPE (capture_megatron.megatron.gpu.rope).
Never called on a real GPU or for CPU runs.
"""

from __future__ import annotations

import sys


def install() -> None:
    """Register the fake-cuda kernels (idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    from capture_megatron.megatron.gpu import compiled, linear
    from capture_megatron.megatron.gpu.rope import fused_apply_rotary_pos_emb, install_mla_rope
    from capture_megatron.megatron.gpu.softmax import extensions

    for name, module in extensions().items():
        sys.modules.setdefault(name, module)
    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    compiled.install()
    linear.install()
    install_mla_rope()
