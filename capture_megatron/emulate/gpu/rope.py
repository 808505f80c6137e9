"""Transformer Engine's fused RoPE, as megatron-core calls it (`fused_apply_rotary_pos_emb` in
megatron/core/models/common/embeddings/rope_utils.py when config.apply_rope_fusion).

What the kernel keeps (TransformerEngine 5671fd36):
- FusedRoPEFunc.forward (transformer_engine/pytorch/attention/rope.py:122-158) calls
  tex.fused_rope_forward, which allocates one output like the input
  (csrc/extensions/apply_rope.cpp:23-25 `at::empty(input.sizes(), ...)`), and saves only
  `freqs` (fp32 [s, 1, 1, d], the rotary module's table: no new bytes), cu_seqlens and
  start_positions (None here) — not the input.
- backward (rope.py:161-175) allocates one gradient like the incoming one.
The unfused path (megatron's _apply_rotary_pos_emb_bshd) instead keeps cos/sin products and the
rotated halves; this is what a GPU run with --transformer-impl transformer_engine keeps.
"""

from __future__ import annotations

import torch

from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import is_fake


def _rotate(t: torch.Tensor, freqs: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """Megatron's non-interleaved rotation of the first d2 channels, t cos + rotate_half(t) sin
    with rotate_half(x) = [-x2, x1]; `adjoint`: its transpose, g cos + [y2, -y1] for y = g sin
    (the backward)."""
    d2 = freqs.shape[-1]
    f = freqs[: t.shape[0]].to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    rot, rest = t[..., :d2].to(f.dtype), t[..., d2:]
    if adjoint:
        y1, y2 = (rot * f.sin()).chunk(2, dim=-1)
        out = rot * f.cos() + torch.cat((y2, -y1), dim=-1)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        out = rot * f.cos() + torch.cat((-x2, x1), dim=-1) * f.sin()
    return torch.cat((out.to(t.dtype), rest), dim=-1)


class FusedRoPE(torch.autograd.Function):
    """Rotary embedding of t [s, b, h, d] that keeps only `freqs` for backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """An output like `t` (the rotated input)."""
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        if not is_fake(t):
            out.copy_(_rotate(t, freqs, adjoint=False))
        ctx.save_for_backward(freqs)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """One gradient like the incoming one (the inverse rotation)."""
        (freqs,) = ctx.saved_tensors
        grad_input = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        if not is_fake(grad):
            grad_input.copy_(_rotate(grad, freqs, adjoint=True))
        return grad_input, None


def fused_apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    transpose_output_memory: bool = False,
    interleaved: bool = False,
) -> torch.Tensor:
    """megatron's fused_apply_rotary_pos_emb (sbhd) on FusedRoPE."""
    del transpose_output_memory
    if interleaved:
        from capture_megatron.errors import CaptureError

        raise CaptureError("--rotary-interleaved with fused RoPE is not modelled yet")
    if freqs.dtype != torch.float32:
        freqs = freqs.float()  # as FusedRoPEFunc.forward does
    return FusedRoPE.apply(t, freqs)


MLA_ROPE_KERNELS = (
    "rotary_fwd_q_kernel",
    "rotary_bwd_q_kernel",
    "rotary_fwd_kv_kernel",
    "rotary_bwd_kv_kernel",
)
"""The Triton kernels of megatron's fused MLA YaRN RoPE
(megatron/core/fusions/fused_mla_yarn_rope_apply.py, config.apply_rope_fusion with MLA)."""


class _TritonLaunch:
    """A Triton kernel as `kernel[grid](*args)` launches it, on fake tensors only: megatron's
    autograd functions around these kernels allocate every tensor themselves (the query's rotation
    in place, new key / value outputs, the backward's d_kv and d_emb, contiguous copies of
    strided gradients) and keep only the cached cos / sin tables; the kernels only write into
    them."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and not is_fake(*tensors):
            from capture_megatron.errors import CaptureError

            raise CaptureError(
                f"megatron's Triton kernel {self.name} (fused MLA RoPE) has no CPU version; the "
                "GPU kernel set runs it on the fake CUDA device only"
            )


def install_mla_rope() -> None:
    """Give megatron's fused MLA RoPE its kernels' launches (no Triton on this machine)."""
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mla_rope

    for name in MLA_ROPE_KERNELS:
        why = "fake-cuda kernel set: fused MLA RoPE's Triton kernel launches"
        patches.patch(mla_rope, name, _TritonLaunch(name), why)
