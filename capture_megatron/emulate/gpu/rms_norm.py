"""torch's fused RMSNorm CUDA kernel (`aten::_fused_rms_norm`), which a CPU build of torch lacks.

On a GPU, torch.nn.RMSNorm (megatron's local spec without apex builds it through WrappedTorchNorm:
the layers' norms, the final norm, --qk-layernorm) calls F.rms_norm -> `aten::rms_norm`, which for
an input and weight of one dtype calls `aten::_fused_rms_norm` (aten/src/ATen/native/layer_norm.cpp,
rms_norm_symint). That operator has CUDA, MPS and XPU kernels and a CompositeImplicitAutograd
fallback (native_functions.yaml). On CUDA its autograd formula (tools/autograd/derivatives.yaml)
saves the input, the weight and `rstd` (fp32, one value per row), and its backward calls
`_fused_rms_norm_backward` (dX like the input, dgamma like the weight).

A CPU build of torch registers no CUDA kernel for it, so the dispatcher decomposes it above
autograd for a CUDA tensor as it does for a CPU one (the CompositeImplicitAutograd kernel serves a
backend's autograd key when the backend has no kernel of its own): on the fake CUDA device the
norm kept the upcast fp32 input and the fp32 normalised input, 8 bytes per element, where a bf16
GPU run keeps the 2-byte input. Measured against the H100's own probe records
(bench/results/gpu/h100-run-a): +117 MB per Llama-style layer at s*b*h = 8M elements, +6% on the
whole run's forecast (issue 52).

Registering a CUDA kernel for the operator makes the dispatcher route the CUDA autograd key to
torch's own autograd formula, as in a CUDA build; FakeTensorMode then produces the outputs
(y in the input's dtype, rstd in fp32) without calling the kernel, and `_fused_rms_norm_backward`
runs its meta kernel. The kernel registered here is reached only by a real CUDA tensor, which a
CPU build cannot hold.
"""

from __future__ import annotations

from capture_megatron.emulate import patches

OPERATOR = "_fused_rms_norm"
"""The aten operator whose CUDA kernel the CPU build lacks."""


def _unreachable(*args, **kwargs):
    """The CUDA kernel's stand-in: fake CUDA tensors never reach a CUDA kernel (FakeTensorMode
    answers first), and a CPU build holds no real CUDA tensor."""
    from capture_megatron.errors import CaptureError

    raise CaptureError(f"aten::{OPERATOR} has no CUDA kernel in this torch build (fake-cuda only)")


def install() -> None:
    """Give `aten::_fused_rms_norm` a CUDA kernel, so that CUDA tensors take its autograd
    formula (what the GPU keeps) instead of the CPU decomposition; a CUDA build of torch has its
    own."""
    import torch

    ours = f"torch.ops.aten.{OPERATOR}" in {p.target for p in patches.applied()}
    if not ours and torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{OPERATOR}", "CUDA"):
        return
    why = "fake-cuda kernel set: torch's fused RMSNorm CUDA kernel (keeps the input and fp32 rstd)"
    patches.kernel(OPERATOR, "CUDA", _unreachable, why)
