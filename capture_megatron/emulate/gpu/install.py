"""Put the GPU kernel modules where megatron-core looks for the real kernels (fake-cuda only).

- sys.modules['scaled_upper_triang_masked_softmax_cuda' | 'scaled_masked_softmax_cuda' |
  'scaled_softmax_cuda']: imported inside megatron/core/fusions/fused_softmax.py's autograd
  Functions when config.masked_softmax_fusion and the kernel's shape conditions hold;
- megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb: megatron's hook
  for Transformer Engine's fused RoPE (config.apply_rope_fusion);
- megatron.core.fusions.fused_cross_entropy.calculate_gradients: with the buffer its compiled
  form allocates (capture_megatron.emulate.gpu.compiled);
- apex's fused_weight_gradient_mlp_cuda and TE's get_dummy_wgrad in megatron's linear layers,
  and TE's duplicated Linear where megatron's MLA module looks for TELinear
  (capture_megatron.emulate.gpu.linear);
- the Triton kernels of megatron's fused MLA RoPE (capture_megatron.emulate.gpu.rope);
- megatron.core.models.common.language_module.language_module.te_parallel_cross_entropy: TE's
  fused cross entropy (--cross-entropy-fusion-impl te; capture_megatron.emulate.gpu
  .cross_entropy);
- megatron.core.transformer.moe.moe_utils' fused_permute ... fused_moe_aux_loss: TE's fused MoE
  permutation and router kernels (capture_megatron.emulate.gpu.permute, .router);
- torch.ops.aten.embedding_dense_backward: torch's CUDA embedding backward with its work tensors
  (capture_megatron.emulate.gpu.embedding);
- torch.ops.aten._fused_rms_norm: torch's fused RMSNorm CUDA kernel, which a CPU build of torch
  lacks (capture_megatron.emulate.gpu.rms_norm);
- megatron.core.transformer.moe.fused_a2a.HybridEPBuffer and the token dispatcher's
  hybrid_ep_dispatch / hybrid_ep_combine: DeepEP's HybridEP (capture_megatron.emulate.gpu.flex);
- fused_a2a.Buffer, fused_dispatch / fused_combine and _DeepepManager's value-sized steps:
  DeepEP (capture_megatron.emulate.gpu.deepep).
Never called on a real GPU or for CPU runs.
"""

from __future__ import annotations

import sys

from capture_megatron.emulate import patches


def install() -> None:
    """Register the fake-cuda kernels (idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    from capture_megatron.emulate.gpu import (
        compiled,
        cross_entropy,
        deepep,
        embedding,
        flex,
        linear,
        permute,
        rms_norm,
        router,
    )
    from capture_megatron.emulate.gpu.rope import fused_apply_rotary_pos_emb, install_mla_rope
    from capture_megatron.emulate.gpu.softmax import extensions

    for name, module in extensions().items():
        if name not in sys.modules:
            why = "fake-cuda kernel set: megatron's fused softmax CUDA extension"
            patches.patch(sys.modules, name, module, why, adds=True)
    why = "fake-cuda kernel set: TE's fused RoPE (apply_rope_fusion)"
    patches.patch(rope_utils, "fused_apply_rotary_pos_emb", fused_apply_rotary_pos_emb, why)
    compiled.install()
    cross_entropy.install()
    embedding.install()
    flex.install()
    deepep.install()
    linear.install()
    permute.install()
    rms_norm.install()
    router.install()
    install_mla_rope()
