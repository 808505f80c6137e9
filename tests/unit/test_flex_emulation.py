"""The GPU kernel set's HybridEP (capture_megatron.emulate.gpu.flex) against the library's contract
(deepseek-ai/DeepEP hybrid-ep eb9cee7, deep_ep/hybrid_ep_buffer.py and the C++ runtime's torch
allocations), driven through megatron-core 0.16.1's own HybridEPDispatch / HybridEPCombine; and a
forecast of the flex dispatcher against the alltoall dispatcher on a tiny MoE."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capture_megatron.config import versions

pytestmark = pytest.mark.skipif(
    versions.current() != versions.V0_16,
    reason="the GPU kernel set emulates HybridEP as megatron-core 0.16 calls it; on 0.19 flex "
    "probes are refused (test_flex_is_refused_on_megatron_core_0_19)",
)

T, H, E, EP = 100, 64, 8, 4  # tokens on this rank, hidden, experts, expert-parallel group
L = E // EP


@pytest.fixture
def group():
    from megatron.core import parallel_state as ps

    from capture_megatron.emulate import cpu_compat
    from capture_megatron.emulate.gpu import flex
    from capture_megatron.profile.groups import fake_job

    cpu_compat.apply("cpu")
    flex.install()
    flex.reset()
    with fake_job(tp=1, dp=EP, ep=EP):
        yield ps.get_expert_tensor_and_model_parallel_group()
    flex.reset()


def test_dispatch_and_combine_return_what_hybridep_returns(group):
    """megatron-core's padded path (num_permuted_tokens = capacity x group x local experts): the
    permuted tokens in the input's dtype, float32 probabilities per permuted row, int64 tokens per
    expert; the handle's maps and row_id_map [max(tokens, 512) x group, local experts]; combine
    restores [tokens, hidden]; the backward passes give the input's gradients (the routing
    probabilities' as float32 [tokens, experts])."""
    from megatron.core.transformer.moe import fused_a2a

    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    routing_map = torch.zeros(T, E, dtype=torch.bool)
    routing_map[:, :2] = True
    probs = torch.rand(T, E, dtype=torch.float32, requires_grad=True)
    n = 25 * EP * L
    out, out_probs, scaling, per_expert, handle = fused_a2a.HybridEPDispatch.apply(
        x, routing_map, probs, group, L, 16, 16, n, None
    )
    assert out.shape == (n, H) and out.dtype == torch.bfloat16
    assert out_probs.shape == (n,) and out_probs.dtype == torch.float32
    assert scaling is None
    assert per_expert.shape == (L,) and per_expert.dtype == torch.int64
    buffer = fused_a2a._hybrid_ep_buffer
    assert buffer.group_size == EP and buffer.max_num_of_tokens_per_rank == 512
    sparse, rdma_to_attn, attn_to_rdma, count, local_map, row_id_map, tokens, _, flag = handle
    assert sparse.shape == (T, EP) and sparse.dtype == torch.int32
    assert rdma_to_attn.shape == (112, 1) and attn_to_rdma.shape == (T, 0)
    assert count.shape == (1,) and count.dtype == torch.int32
    assert local_map.shape == (T * EP, L) and local_map.dtype == torch.bool
    assert row_id_map.shape == (512 * EP, L) and row_id_map.dtype == torch.int32
    assert tokens == T and flag.shape == (1,)
    combined = fused_a2a.HybridEPCombine.apply(out, handle, n, None)
    assert combined.shape == (T, H) and combined.dtype == torch.bfloat16
    (combined.float().sum() + out_probs.sum()).backward()
    assert x.grad.shape == (T, H) and x.grad.dtype == torch.bfloat16
    assert probs.grad.shape == (T, E) and probs.grad.dtype == torch.float32


def test_hybridep_refuses_what_the_library_refuses(group):
    from capture_megatron.emulate.gpu.flex import HybridEPBuffer

    with pytest.raises(ValueError):
        HybridEPBuffer(group, H, T, L, use_fp8=True)
    buffer = HybridEPBuffer(group, H, T, L)
    x = torch.randn(T, H)
    with pytest.raises(ValueError):  # megatron-core passes a bool routing map
        buffer.dispatch_with_permute(hidden=x, routing_map=torch.zeros(T, E), num_permuted_tokens=8)
    handle = buffer.dispatch_with_permute(
        hidden=x.bfloat16(), routing_map=torch.zeros(T, E, dtype=torch.bool), num_permuted_tokens=8
    )[4]
    with pytest.raises(ValueError):  # combine_with_unpermute asserts 2-byte elements
        buffer.combine_with_unpermute(hidden=torch.randn(8, H), handle=handle)


def _probe(dispatcher: str, backend: str, router_dtype: str):
    from capture_megatron.config import Kernels
    from capture_megatron.features.moe import Experts
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import ExpertsProbe, Probe, ProbeShape, Variant

    experts = Experts(
        num_experts=4, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
        moe_flex_dispatcher_backend=backend, moe_grouped_gemm=True,
        moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
        moe_aux_loss_coeff=0.01, moe_router_dtype=router_dtype,
    )  # fmt: skip
    variant = Variant("bf16", "none", True, True, "RMSNorm", "rope", False, False, True)
    variant = dataclasses.replace(variant, moe=ExpertsProbe(experts, 2, 1, "exact"))
    shape = ProbeShape(2, 128, 128, 4, 4, 32, 256, 256, 2)
    kernels = Kernels(moe_permute_fusion=True)
    return run_probes([Probe(variant, shape, "middle", 1)], "fake-cuda", kernels, progress=False)[0]


@pytest.mark.slow
def test_flex_forecast_against_alltoall_at_balanced_routing():
    """One MoE layer (4 experts, top-2, EP 2, capacity 1: every expert receives its balanced
    share) on the GPU kernel set, with float32 routing probabilities (--moe-router-dtype fp32, as
    HybridEP needs). Expected: the same weights, gradients, optimizer state and backward peak;
    saved activations within 1% (megatron's dispatchers keep different index tensors); a lower
    forward peak for flex, whose one fused call returns the expert-ordered tokens where alltoall
    holds the locally permuted tokens and the all-to-all's output together ([tokens x top-k,
    hidden] bf16 each, 64 KiB here); no routing state beyond the step for flex (HybridEP's
    handle is freed by the dispatch's backward) where alltoall keeps its permutation map."""
    flex, a2a = _probe("flex", "hybridep", "fp32"), _probe("alltoall", "deepep", "fp32")
    for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "backward_peak"):
        assert getattr(flex, name) == getattr(a2a, name), name
    assert abs(flex.saved_bytes - a2a.saved_bytes) <= 0.01 * a2a.saved_bytes
    permuted = 128 * 2 * 128 * 2  # tokens x top-k x hidden, bf16
    assert a2a.forward_peak - flex.forward_peak >= permuted
    assert flex.routing_state_bytes == 0 < a2a.routing_state_bytes
