"""Transformer Engine's fused LayerNorm / RMSNorm, as TE's LayerNormLinear (megatron's
TELayerNormColumnParallelLinear: linear_qkv and linear_fc1) and TENorm (the final norm) run them.

What the kernels keep (TE 5671fd36): the norm input x (the module's input: no new bytes) and fp32
statistics of one value per row — mu and rsigma for LayerNorm, rsigma only for RMSNorm
(pytorch/csrc/extensions/normalization.cpp:87-88, 325; module/layernorm_linear.py:463-473;
ops/basic/layer_norm.py:198-221, rmsnorm.py:182-203). The normalised output is a new tensor,
kept by the linear layer that follows (megatron's ColumnParallelLinear keeps its input, as TE's
LayerNormLinear keeps ln_out). The backward allocates dx, dgamma (dbeta) and a workspace of
per-CTA partial gamma (beta) gradients, about #SM x h fp32 each (common/normalization/common.h).
torch's eager RMSNorm instead keeps fp32 copies of x, which is what a CPU run keeps.
"""

from __future__ import annotations

import torch

from capture_megatron.emulate.gpu.attention import SM_COUNT
from capture_megatron.emulate.gpu.common import is_fake


def _normalise(x, weight, bias, eps: float, rms: bool):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    mu = None if rms else xf.mean(-1, keepdim=True)
    centred = xf if rms else xf - mu
    rsigma = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    y = centred * rsigma * weight
    return (y if bias is None else y + bias).to(x.dtype), mu, rsigma


class TENormFunction(torch.autograd.Function):
    """y = norm(x) keeping x, the weight (and bias) and fp32 [rows] statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool):
        """The normalised x in x's dtype."""
        rows = x.numel() // x.shape[-1]
        y = torch.empty_like(x)
        rsigma = torch.empty(rows, dtype=torch.float32, device=x.device)
        mu = None if rms else torch.empty(rows, dtype=torch.float32, device=x.device)
        if not is_fake(x):
            out, m, r = _normalise(x, weight, bias, eps, rms)
            y.copy_(out)
            rsigma.copy_(r.reshape(-1))
            if mu is not None:
                mu.copy_(m.reshape(-1))
        ctx.save_for_backward(x, weight, bias, mu, rsigma)
        ctx.eps, ctx.rms = eps, rms
        return y

    @staticmethod
    def backward(ctx, grad):
        """dx, dgamma, dbeta."""
        x, weight, bias, mu, rsigma = ctx.saved_tensors
        grad = grad.contiguous()  # TE: dy = grad_output.contiguous()
        dx = torch.empty_like(x)
        dw = torch.empty_like(weight)
        db = None if bias is None else torch.empty_like(bias)
        parts = 1 if ctx.rms else 2
        workspace = torch.empty((parts, SM_COUNT, x.shape[-1]), device=x.device)
        if not is_fake(x):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (x, weight)]
                leaves += [] if bias is None else [bias.detach().requires_grad_()]
                out, _, _ = _normalise(leaves[0], leaves[1], leaves[2] if bias is not None
                                       else None, ctx.eps, ctx.rms)  # fmt: skip
                grads = torch.autograd.grad(out, leaves, grad)
            dx.copy_(grads[0])
            dw.copy_(grads[1])
            if db is not None:
                db.copy_(grads[2])
        del workspace
        return dx, dw, db, None, None


class TENorm(torch.nn.Module):
    """TE's LayerNorm / RMSNorm with LocalNorm's constructor (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.rms, self.eps = config.normalization == "RMSNorm", eps
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for param in self.parameters():
            # megatron-core's marker attribute on parameters (read by finalize_model_grads)
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised x; TE's norm ops normalise (and keep) a contiguous x
        (`input_.contiguous()` in ops/basic/layer_norm.py / rmsnorm.py op_forward): a copy of a
        strided view such as the query and key heads split from the fused QKV output
        (--qk-layernorm)."""
        return TENormFunction.apply(x.contiguous(), self.weight, self.bias, self.eps, self.rms)
