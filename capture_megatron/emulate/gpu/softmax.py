"""Megatron's fused softmax kernels as the CUDA extensions FusedScaleMaskSoftmax imports.

megatron/core/fusions/fused_softmax.py (core_v0.16.1) imports
`scaled_upper_triang_masked_softmax_cuda` (causal), `scaled_masked_softmax_cuda` and
`scaled_softmax_cuda` (apex's builds of the kernels in
TransformerEngine transformer_engine/common/fused_softmax/*.cu) and keeps what their `forward`
returns for backward. What the kernels allocate:
- forward: one output in the input's dtype and shape (the 16-bit softmax; fp32 is only used
  inside the kernel), `softmax_results = torch::empty(...)` in apex's scaled_*_softmax_cuda.cu;
- backward: nothing: the input gradient is written into `output_grads` in place and returned.
`get_batch_per_block` is the kernels' launch arithmetic (scaled_upper_triang_masked_softmax.cu
line 345-362 at TE 5671fd36): 128 threads per block, warps of min(next_pow2(sk), 32) threads, two
rows per warp when next_pow2(sk) <= 128.
Registered in sys.modules by capture_megatron.emulate.gpu.install on the fake-cuda device only.
"""

from __future__ import annotations

import types

import torch

from capture_megatron.emulate.gpu.common import is_fake

MASK_FILL = -10000.0
"""What the masked kernels put in masked positions before the softmax (scaled_masked_softmax.h)."""


def batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """Rows of attention one thread block handles (the kernels' launch arithmetic)."""
    del sq, b, np
    pow2 = 1 << max(0, (sk - 1).bit_length())
    warp = min(pow2, 32)
    return (128 // warp) * (2 if pow2 <= 128 else 1)


def _softmax(x: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    y = x.float() * scale
    if mask is not None:
        y = y.masked_fill(mask, MASK_FILL)
    return torch.softmax(y, dim=-1).to(x.dtype)


def _forward(inputs: torch.Tensor, scale, mask: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(inputs)
    if not is_fake(inputs):
        out.copy_(_softmax(inputs, float(scale), mask))
    return out


def _backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale) -> torch.Tensor:
    if not is_fake(output_grads):
        g, y = output_grads.float(), softmax_results.float()
        output_grads.copy_((g - (g * y).sum(-1, keepdim=True)) * y * float(scale))
    return output_grads


def _causal_forward(inputs: torch.Tensor, scale) -> torch.Tensor:
    sq, sk = inputs.shape[-2:]
    mask = None
    if not is_fake(inputs):
        mask = torch.ones(sq, sk, dtype=torch.bool, device=inputs.device).triu(1)
    return _forward(inputs, scale, mask)


def _module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name, f"capture-megatron's fake-cuda {name} (see {__name__})")
    for key, fn in functions.items():
        setattr(module, key, fn)
    return module


def extensions() -> dict[str, types.ModuleType]:
    """The three extension modules, by the names megatron imports."""
    return {
        "scaled_upper_triang_masked_softmax_cuda": _module(
            "scaled_upper_triang_masked_softmax_cuda",
            forward=_causal_forward,
            backward=_backward,
        ),
        "scaled_masked_softmax_cuda": _module(
            "scaled_masked_softmax_cuda",
            forward=lambda inputs, mask, scale: _forward(inputs, scale, mask),
            backward=_backward,
            get_batch_per_block=batch_per_block,
        ),
        "scaled_softmax_cuda": _module(
            "scaled_softmax_cuda",
            forward=lambda inputs, scale: _forward(inputs, scale),
            backward=_backward,
        ),
    }
