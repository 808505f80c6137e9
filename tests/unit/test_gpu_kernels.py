"""The GPU kernel set's modules (capture_megatron.emulate.gpu) on real CPU tensors: each computes
what the plain torch / megatron path computes (values and gradients) and keeps, for backward,
exactly the tensors its source says the real kernel keeps."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from capture_megatron.emulate.gpu import compiled, rope, softmax
from capture_megatron.emulate.gpu.attention import CuDNNAttention, FlashAttention2
from capture_megatron.emulate.gpu.layout import te_qkv
from capture_megatron.memory.live import LiveTensorTracker


def _saved(out: torch.Tensor) -> list[torch.Tensor]:
    """The tensors out's autograd node keeps for backward."""
    return list(out.grad_fn.saved_tensors)


def _causal_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    mask = torch.ones(x.shape[-2:], dtype=torch.bool).triu(1)
    return torch.softmax(x.float().mul(scale).masked_fill(mask, -10000.0), -1)


def test_fused_causal_softmax_matches_torch_and_runs_in_place():
    ext = softmax.extensions()["scaled_upper_triang_masked_softmax_cuda"]
    x = torch.randn(8, 32, 32, dtype=torch.float64)
    y = ext.forward(x, 0.5)
    torch.testing.assert_close(y, _causal_reference(x, 0.5).to(x.dtype))
    grad = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    (_causal_reference(leaf, 0.5) * grad).sum().backward()
    incoming = grad.clone()
    back = ext.backward(incoming, y, 0.5)
    assert back.data_ptr() == incoming.data_ptr()  # written into the incoming gradient
    torch.testing.assert_close(back, leaf.grad)


@pytest.mark.parametrize("sk, expected", [(64, 8), (128, 8), (256, 4), (1024, 4), (4096, 4)])
def test_batch_per_block_is_the_kernels_launch_arithmetic(sk, expected):
    assert softmax.batch_per_block(sk, sk, 1, 1) == expected


def test_fused_rope_matches_megatron_and_keeps_only_freqs():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    s, b, heads, d = 16, 2, 4, 8
    freqs = torch.randn(s, 1, 1, d, dtype=torch.float32)
    t = torch.randn(s, b, heads, d, dtype=torch.float64, requires_grad=True)
    out = rope.fused_apply_rotary_pos_emb(t, freqs)
    ref_t = t.detach().clone().requires_grad_()
    ref = _apply_rotary_pos_emb_bshd(ref_t, freqs.double())
    torch.testing.assert_close(out, ref)
    assert [x.data_ptr() for x in _saved(out)] == [freqs.data_ptr()]
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(t.grad, ref_t.grad)


def _qkv(s=32, b=2, heads=4, groups=2, d=8, dtype=torch.float64):
    q = torch.randn(s, b, heads, d, dtype=dtype, requires_grad=True)
    k = torch.randn(s, b, groups, d, dtype=dtype, requires_grad=True)
    v = torch.randn(s, b, groups, d, dtype=dtype, requires_grad=True)
    return q, k, v


def _sdpa(q, k, v, scale):
    """torch's SDPA on sbhd inputs, GQA by repetition."""
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3)


def test_cudnn_attention_matches_sdpa_and_keeps_no_s_by_s_tensor():
    q, k, v = _qkv()
    scale = 1 / math.sqrt(q.shape[-1])
    out = CuDNNAttention.apply(q, k, v, scale, 0.0)
    torch.testing.assert_close(out, _sdpa(q, k, v, scale))
    s, b, heads, _ = q.shape
    kept = _saved(out)
    assert [tuple(x.shape) for x in kept] == [
        tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(q.shape), (b, heads, s, 1), (2,)
    ]  # fmt: skip
    assert kept[4].dtype == torch.float32 and kept[5].dtype == torch.int64
    assert kept[0].data_ptr() == q.data_ptr() and kept[3].data_ptr() == out.data_ptr()
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(_sdpa(q, k, v, scale), (q, k, v), grad)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


def test_flash_attention_matches_sdpa_and_keeps_lse():
    q, k, v = _qkv()
    scale = 0.3
    qb, kb, vb = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    out = FlashAttention2.apply(qb, kb, vb, scale, False)
    torch.testing.assert_close(out.transpose(0, 1), _sdpa(q, k, v, scale))
    b, s, heads, _ = qb.shape
    assert [tuple(x.shape) for x in _saved(out)][3:] == [tuple(qb.shape), (b, heads, s), (2,)]
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(_sdpa(q, k, v, scale), (q, k, v), grad.transpose(0, 1))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


def _split_qkv(s, b, groups, per_group, d):
    """megatron's fused QKV projection output split into q, k, v views (before any RoPE)."""
    mixed = torch.randn(s, b, groups, (per_group + 2) * d)
    q, k, v = torch.split(mixed, [per_group * d, d, d], dim=3)
    return q.reshape(s, b, -1, d), k, v


def test_te_layout_keeps_mha_views_and_copies_what_te_copies():
    q, k, v = _split_qkv(8, 2, 4, 1, 16)  # MHA without RoPE: sbh3d, no copy
    assert [a.data_ptr() for a in te_qkv(q, k, v)] == [t.data_ptr() for t in (q, k, v)]
    q2, k2 = q.contiguous(), k.contiguous()  # RoPE outputs: fresh q and k, v still a view
    got = te_qkv(q2, k2, v)
    assert got[0].data_ptr() == q2.data_ptr() and got[1].data_ptr() == k2.data_ptr()
    assert got[2].data_ptr() != v.data_ptr() and got[2].is_contiguous()
    q, k, v = _split_qkv(8, 2, 2, 4, 16)  # GQA without RoPE: q is a copy, k and v are copied
    got = te_qkv(q, k, v)
    assert got[0].data_ptr() == q.data_ptr()
    assert got[1].data_ptr() != k.data_ptr() and got[2].data_ptr() != v.data_ptr()


@pytest.mark.slow  # compiles with Inductor: 5-35 s, the full suite runs it
def test_compiled_cross_entropy_gradient_holds_inductors_fp32_buffer():
    from megatron.core.fusions import fused_cross_entropy as fce

    s, b, vocab = 8, 2, 64
    logits = torch.randn(s, b, vocab, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (s, b))
    plain = (
        fce.calculate_gradients.__wrapped__
        if hasattr(fce.calculate_gradients, "__wrapped__")
        else fce.calculate_gradients
    )
    wrapped = compiled.with_inductor_buffer(plain)
    peaks = []
    for fn in (plain, wrapped):
        x, m = fce.calculate_logits_max(logits.clone())
        tm, mt, pl, e = fce.calculate_predicted_logits(x, target, m, 0, vocab)
        e, _ = fce.calculate_cross_entropy_loss(e, pl)
        with LiveTensorTracker() as tracker:
            grad = fn(e, torch.ones(s, b), tm, mt)
            peaks.append(tracker.peak_bytes)
        assert grad.dtype == torch.bfloat16
    assert peaks[1] - peaks[0] == s * b * vocab * 4


class _Config:
    params_dtype = torch.float64
    sequence_parallel = False

    def __init__(self, normalization: str):
        self.normalization = normalization


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_te_norm_matches_torch_and_keeps_x_and_fp32_statistics(normalization):
    from capture_megatron.emulate.gpu.norm import TENorm

    h, rows = 16, 12
    norm = TENorm(_Config(normalization), h)
    with torch.no_grad():
        norm.weight.uniform_()
        if norm.bias is not None:
            norm.bias.uniform_()
    ref = (torch.nn.RMSNorm if normalization == "RMSNorm" else torch.nn.LayerNorm)(
        h, eps=1e-5, dtype=torch.float64
    )
    ref.load_state_dict(norm.state_dict())
    x = torch.randn(rows, h, dtype=torch.float64, requires_grad=True)
    y = norm(x)
    torch.testing.assert_close(y, ref(x))
    kept = [t for t in _saved(y) if t is not None and t.dim() == 1 and t.dtype == torch.float32]
    assert [tuple(t.shape) for t in kept] == [(rows,)] * (1 if normalization == "RMSNorm" else 2)
    assert _saved(y)[0].data_ptr() == x.data_ptr()
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *norm.parameters()], grad)
    want = torch.autograd.grad(ref(x), [x, *ref.parameters()], grad)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


def test_ring_attention_keeps_what_te_p2p_keeps_and_returns_views_of_its_ring():
    """TE's AttnFuncWithCPAndKVP2P (CP 2, flash bshd) on fake tensors: it keeps q, the last ring
    buffer (K and V), the merged output, the merged fp32 lse and one rng state per step; dK and dV
    come back as views of one [2, K+V] ring buffer; real tensors are refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from capture_megatron.emulate.gpu.cp import RingAttention, flash_bwd_workspace
    from capture_megatron.errors import CaptureError

    workspace = partial(flash_bwd_workspace, sm_count=132, det=True)

    b, s, heads, groups, d = 2, 16, 4, 2, 8
    with FakeTensorMode():
        q = torch.empty(b, s, heads, d, dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.empty(b, s, groups, d, dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
        )
        out = RingAttention.apply(q, k, v, 2, "bshd", workspace)
        saved = [(tuple(t.shape), t.dtype) for t in _saved(out)]
        assert saved == [
            ((b, s, heads, d), torch.bfloat16),
            ((2 * k.numel(),), torch.bfloat16),
            ((b, s, heads, d), torch.bfloat16),
            ((b, heads, s), torch.float32),
            ((2,), torch.int64),
            ((2,), torch.int64),
        ]
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        ring = dk.untyped_storage()
        assert (
            ring.nbytes() == 2 * 2 * k.numel() * 2
            and dv.untyped_storage().nbytes() == ring.nbytes()
        )
    with pytest.raises(CaptureError, match="fake CUDA device only"):
        RingAttention.apply(*(torch.zeros(1, 2, 1, 1) for _ in "qkv"), 2, "bshd", workspace)


@pytest.mark.parametrize("fuse", [False, True])
def test_grouped_linear_matches_per_expert_gemms_and_keeps_input_views(fuse):
    """TE's _GroupedLinear without fp8: the output is each expert's GEMM over its split of the
    input; backward keeps only views of the input (no copy), returns one dgrad and, with fused
    wgrad accumulation, adds into main_grad and hands autograd a fresh tensor per weight (TE's
    handle_custom_ddp_from_mcore) -- without fusion, the weight gradients themselves."""
    from capture_megatron.emulate.gpu.grouped import GroupedLinearFunction

    torch.manual_seed(0)
    splits = [3, 5, 0, 4]
    x = torch.randn(sum(splits), 6, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(7, 6, dtype=torch.float64, requires_grad=True) for _ in splits]
    for w in weights:
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
    out = GroupedLinearFunction.apply(x, splits, fuse, *weights)
    parts = torch.split(x, splits)
    torch.testing.assert_close(out, torch.cat([p @ w.t() for p, w in zip(parts, weights)]))
    saved = _saved(out)
    assert len(saved) == len(splits)
    assert all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *weights], grad)
    ref_x = torch.cat([g @ w for g, w in zip(torch.split(grad, splits), weights)])
    torch.testing.assert_close(got[0], ref_x)
    want = [g.t() @ p for g, p in zip(torch.split(grad, splits), parts)]
    for w, g, ref in zip(weights, got[1:], want):
        torch.testing.assert_close(w.main_grad if fuse else g, ref)
        assert g.shape == w.shape and w.grad_added_to_main_grad == fuse


def test_te_cross_entropy_matches_torch_and_keeps_only_the_logits():
    """TE's fused cross entropy (--cross-entropy-fusion-impl te): the per-token loss and the
    gradient of torch's cross entropy; it keeps the logits' own storage (overwritten with the
    gradient, 2 bytes per logit in bf16) and returns it as the gradient."""
    from capture_megatron.emulate.gpu.cross_entropy import TECrossEntropy

    s, b, vocab = 6, 3, 11
    x = torch.randn(s, b, vocab, dtype=torch.float64)
    target = torch.randint(0, vocab, (s, b))
    leaf = x.clone().requires_grad_()
    logits = leaf * 1  # an output layer's output
    loss = TECrossEntropy.apply(logits, target, None)
    ref = F.cross_entropy(x.view(-1, vocab), target.view(-1), reduction="none").view(s, b)
    torch.testing.assert_close(loss, ref.float())
    (kept,) = _saved(loss)
    assert kept.data_ptr() == logits.data_ptr() and kept.dtype == x.dtype
    weights = torch.rand(s, b)
    (loss * weights).sum().backward()
    want = torch.autograd.grad(
        (F.cross_entropy(x.requires_grad_().view(-1, vocab), target.view(-1), reduction="none")
         * weights.view(-1).double()).sum(), x,
    )[0]  # fmt: skip
    torch.testing.assert_close(leaf.grad, want)


@pytest.mark.slow
def test_te_cross_entropy_keeps_two_bytes_per_logit_on_the_last_stage():
    """On the fake-cuda device --cross-entropy-fusion-impl te runs (megatron raises without TE)
    and a last stage keeps 2 bytes per logit more for each vocabulary entry more, in its saved
    bytes and its forward peak (no fp32 softmax), and its backward allocates nothing per logit
    (the gradient is the logits' storage)."""
    import dataclasses

    from capture_megatron.config import Kernels
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import Probe, ProbeShape, Variant

    variant = Variant("bf16", "none", True, True, "RMSNorm", "rope", False, False, True)
    te = Kernels(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    b, s, t = 2, 128, 2
    small = ProbeShape(b, s, 128, 4, 4, 32, 256, 1024, t)
    big = dataclasses.replace(small, padded_vocab=2048)
    one, two = run_probes([Probe(variant, z, "last", 0) for z in (small, big)], "fake-cuda", te)
    per_entry = 2 * s * b // t
    assert two.saved_bytes - one.saved_bytes == per_entry * (2048 - 1024)
    assert two.forward_peak - one.forward_peak == per_entry * (2048 - 1024)
    assert two.backward_peak == one.backward_peak
