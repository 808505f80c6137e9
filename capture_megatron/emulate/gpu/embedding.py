"""torch's CUDA embedding backward (`aten::embedding_dense_backward`), with the work tensors its
kernel allocates.

megatron's VocabParallelEmbedding calls F.embedding; its backward is `embedding_dense_backward`.
On fake tensors that operator runs its meta kernel, which allocates the weight gradient only.
torch's CUDA kernel (aten/src/ATen/native/cuda/Embedding.cu embedding_dense_backward_cuda and
EmbeddingBackwardKernel.cu embedding_backward_cuda_kernel) allocates more:
- a contiguous copy of the incoming gradient when it is strided (`grad_.contiguous()`): the
  embedding's output is [b, s, h] and megatron transposes it to [s, b, h], so its gradient is
  strided for micro-batches above 1;
- up to 3072 indices: the zeroed weight gradient only;
- above that, a sort of the indices (sorted and original order, an arange), then the zeroed weight
  gradient, per-segment offsets and counts ([min(n, vocab)] each, index dtype, two int64
  scalars), partial-segment offsets ([n / 10 + min(n, vocab)], NROWS_PER_THREAD = 10) and the
  partial sums per segment, [n / 10 + min(n, vocab), h] in fp32 for 16-bit gradients (the kernel
  sizes them for the worst case, without reading the number of distinct tokens);
- with scale_grad_by_freq, one more index tensor (the counts).
All of them but the weight gradient are freed when the kernel returns. Measured on the H100
(bench/results/gpu/h100-run-b, the embedding-only probe at micro-batch 4, 8192 tokens of a
32000 x 2048 vocabulary): 107,773,440 bytes above the meta kernel's, which is this list to the
byte once each tensor is rounded up to the caching allocator's 512-byte blocks (the fake device
counts tensor bytes: 1,112 fewer; cub's sort scratch is freed before the peak).

Registered on the CUDA autograd key (above the fake tensor mode and the memory meter, so that the
meter sees each allocation); only fake CUDA tensors reach it.
"""

from __future__ import annotations

import torch

from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import is_fake

OPERATOR = "embedding_dense_backward"
"""The aten operator emulated."""
FEATURE_KERNEL_MAX = 3072
"""Up to this many indices the CUDA kernel accumulates per feature without sorting."""
NROWS_PER_THREAD = 10
"""Rows of one partial segment (EmbeddingBackwardKernel.cu)."""


def _sorted_path(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, scale: bool):
    """embedding_dense_backward_cuda's sort and embedding_backward_cuda_kernel's work tensors;
    returns the weight gradient."""
    n, h, device = indices.numel(), grad.shape[-1], grad.device

    def index(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=indices.dtype, device=device)

    def scalar() -> torch.Tensor:
        return torch.empty((), dtype=torch.int64, device=device)

    sorted_indices, orig_indices = index(n), index(n)
    arange = index(n)  # the sort's values, freed after it
    del arange
    count = index(n) if scale else None
    grad_weight = torch.zeros((num_weights, h), dtype=grad.dtype, device=device)
    segments = min(n, num_weights)
    work = [index(n), scalar()]  # segment offsets, their count
    work += [index(segments), index(segments), scalar()]  # partials per segment, their offsets
    partial = n // NROWS_PER_THREAD + segments
    work += [index(partial)]  # partial-segment offsets
    wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    work += [torch.empty((partial, h), dtype=wide, device=device)]  # partial sums
    del work, count, sorted_indices, orig_indices
    return grad_weight


def embedding_dense_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """What the CUDA kernel allocates (module docstring); the weight gradient (no values: fake
    tensors only)."""
    del padding_idx
    if not is_fake(grad, indices):
        from capture_megatron.errors import CaptureError

        raise CaptureError(f"aten::{OPERATOR} on the CUDA autograd key is fake-cuda only")
    indices = indices.contiguous()
    grad = grad.contiguous()  # a copy when strided; kept until the kernel returns
    if indices.numel() <= FEATURE_KERNEL_MAX and not scale_grad_by_freq:
        return torch.zeros((num_weights, grad.shape[-1]), dtype=grad.dtype, device=grad.device)
    return _sorted_path(grad, indices, num_weights, scale_grad_by_freq)


def install() -> None:
    """Route CUDA tensors' embedding backward through embedding_dense_backward above."""
    why = "fake-cuda kernel set: torch's CUDA embedding backward and its work tensors"
    patches.kernel(OPERATOR, "AutogradCUDA", embedding_dense_backward, why)
