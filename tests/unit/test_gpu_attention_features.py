"""The GPU kernel set's modules for query/key norms and multi-latent attention, on real CPU
tensors: they compute what the modules they stand for compute and keep what those keep (TE norms
normalise a contiguous copy of a strided head; megatron's compiled L2Norm keeps its input and
rsqrt; cuDNN attention with value heads narrower than query/key heads); and what the GPU kernel set
refuses of MLA is refused by flag before any profiling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from capture_megatron.config import Kernels, ModelShape
from capture_megatron.emulate.gpu.attention import CuDNNAttention
from capture_megatron.emulate.gpu.compiled import CompiledL2Norm
from capture_megatron.emulate.gpu.norm import TENorm
from capture_megatron.emulate.gpu.rope import _TritonLaunch
from capture_megatron.errors import CaptureError
from capture_megatron.features.mla import LatentAttention
from capture_megatron.megatron.attention import EagerL2Norm
from capture_megatron.rules.modelled import latent_problem


def _saved(out: torch.Tensor) -> list[torch.Tensor]:
    return list(out.grad_fn.saved_tensors)


def _head_view(s=8, b=2, heads=4, d=16) -> torch.Tensor:
    """A query head view split from a fused [s, b, 3 * heads * d] projection (strided)."""
    fused = torch.randn(s, b, heads, 3 * d, dtype=torch.float64, requires_grad=True)
    return fused[..., :d]


def test_compiled_l2_norm_matches_megatrons_formula_and_keeps_its_input_and_rsqrt():
    x = _head_view()
    y = CompiledL2Norm(16)(x)
    torch.testing.assert_close(y, EagerL2Norm(16)(x))
    kept = _saved(y)
    assert kept[0].data_ptr() == x.data_ptr() and kept[0].stride() == x.stride()  # the view
    assert tuple(kept[1].shape) == (*x.shape[:-1], 1) and kept[1].dtype == torch.float32
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, x, grad)[0]
    want = torch.autograd.grad(EagerL2Norm(16)(x), x, grad)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Config:
    params_dtype = torch.float64
    sequence_parallel = False
    normalization = "RMSNorm"


def test_te_norm_of_a_strided_head_keeps_a_contiguous_copy():
    x = _head_view()
    norm = TENorm(_Config(), 16)
    y = norm(x)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (16,), norm.weight, 1e-5))
    kept = _saved(y)[0]
    assert kept.is_contiguous() and kept.untyped_storage().data_ptr() != x.data_ptr()
    assert tuple(kept.shape) == tuple(x.shape)


def test_cudnn_attention_with_narrower_value_heads():
    s, b, heads, dk, dv = 16, 2, 4, 24, 12
    q, k = (torch.randn(s, b, heads, dk, dtype=torch.float64, requires_grad=True) for _ in "qk")
    v = torch.randn(s, b, heads, dv, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(dk)
    out = CuDNNAttention.apply(q, k, v, scale, 0.0)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    want = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    torch.testing.assert_close(out, want.permute(2, 0, 1, 3))
    assert tuple(out.shape) == (s, b, heads, dv)
    assert tuple(_saved(out)[4].shape) == (b, heads, s, 1)  # fp32 statistics, no s x s tensor


def test_triton_launches_run_on_fake_tensors_only():
    with pytest.raises(CaptureError, match="fake CUDA device only"):
        _TritonLaunch("rotary_fwd_q_kernel")[lambda meta: (1,)](torch.zeros(2))


def _mla_shape(**fields) -> ModelShape:
    mla = LatentAttention(multi_latent_attention=True, qk_head_dim=16, v_head_dim=16, **fields)
    return ModelShape(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=256,
        position_embedding_type="rope",
        mla=mla,
    )


@pytest.mark.parametrize(
    ("kernels", "cp", "fields", "shown"),
    [
        (Kernels(attention_backend="flash"), 1, {}, "FlashAttention 2 does not run"),
        (Kernels(), 1, {"rope_type": "rope"}, "apply_rope_fusion for MLA only works with YaRN"),
        (Kernels(), 2, {}, "--context-parallel-size 2"),
    ],
)
def test_what_the_gpu_kernel_set_does_not_model_of_mla_is_named(kernels, cp, fields, shown):
    shape = _mla_shape(**fields)
    assert shown in latent_problem(shape, "gpu:x", kernels, cp)
    assert latent_problem(shape, "cpu", kernels, cp) == ""


def test_mla_under_the_default_gpu_kernels_is_modelled():
    assert latent_problem(_mla_shape(), "gpu:x", Kernels(), 1) == ""
    assert latent_problem(_mla_shape(rope_type="rope"), "gpu:x", Kernels(rope_fusion=False)) == ""
    flash = Kernels(attention_backend="flash")  # equal head widths: FlashAttention 2 runs
    equal = _mla_shape(qk_pos_emb_head_dim=0)
    assert latent_problem(equal, "gpu:x", flash) == ""
