"""The GPU kernel set's DeepEP (capture_megatron.emulate.gpu.deepep) against the library's contract
(deepseek-ai/DeepEP eb9cee7, deep_ep/buffer.py and the tensors csrc/deep_ep.cpp returns), driven
through megatron-core 0.16.1's own FusedDispatch / FusedCombine; and a forecast of DeepEP against
the alltoall dispatcher on a tiny MoE at balanced routing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capture_megatron.features.dispatch import deepep_received

T, H, E, K, EP = 100, 64, 8, 2, 4  # tokens on this rank, hidden, experts, top-k, group
L = E // EP


@pytest.fixture
def group():
    from megatron.core import parallel_state as ps

    from capture_megatron.emulate import cpu_compat
    from capture_megatron.emulate.gpu import deepep
    from capture_megatron.profile.groups import fake_job

    cpu_compat.apply("cpu")
    deepep.install()
    deepep.reset()
    with fake_job(tp=1, dp=EP, ep=EP):
        yield ps.get_expert_tensor_and_model_parallel_group()
    deepep.reset()


def test_dispatch_and_combine_return_what_deepep_returns(group):
    """At a routing forecast: the received tokens in the input's dtype, int64 top-k indices and
    float32 weights per received token, the per-expert counts (a host list that FusedDispatch
    makes a tensor of); the intranode handle's prefix matrices [ranks, ranks] / [ranks, 10
    channels], source indices [received] and send_head [tokens, ranks]; get_buffer's Buffer
    sized by the size hints; combine restores [tokens, hidden]; both backward passes give the
    inputs' gradients (the weights' as float32 [tokens, top-k])."""
    from megatron.core.transformer.moe import fused_a2a

    from capture_megatron.emulate.gpu import deepep

    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.zeros(T, K, dtype=torch.int64)
    w = torch.rand(T, K, dtype=torch.float32, requires_grad=True)
    counts = deepep_received(T, EP, E, K, L, 1.0)
    deepep._ACTIVE.append(counts)
    try:
        out, recv_idx, recv_w, per_expert, handle = fused_a2a.FusedDispatch.apply(
            x, idx, w, E, group, False, False
        )
    finally:
        deepep._ACTIVE.pop()
    n = counts.tokens
    assert out.shape == (n, H) and out.dtype == torch.bfloat16
    assert recv_idx.shape == (n, K) and recv_idx.dtype == torch.int64
    assert recv_w.shape == (n, K) and recv_w.dtype == torch.float32
    assert per_expert.tolist() == [EP * 25] * L  # ceil(100 x 2 / 8) from each of 4 ranks
    rank_prefix, channel_prefix, recv_channel_prefix, src_idx, in_rank, send_head = handle
    assert rank_prefix.shape == (EP, EP) and channel_prefix.shape == (EP, 10)
    assert recv_channel_prefix.shape == (EP, 10) and src_idx.shape == (n,)
    assert in_rank.shape == (T, EP) and in_rank.dtype == torch.bool
    assert send_head.shape == (T, EP) and send_head.dtype == torch.int32
    buffer = fused_a2a._buffer
    assert buffer.num_nvl_bytes == fused_a2a.Buffer.get_dispatch_config(
        EP
    ).get_nvl_buffer_size_hint(H * 2, EP)
    assert buffer.num_rdma_bytes == 0
    combined, _ = fused_a2a.FusedCombine.apply(out, group, handle, False, False)
    assert combined.shape == (T, H) and combined.dtype == torch.bfloat16
    (combined.float().sum() + recv_w.sum()).backward()
    assert x.grad.shape == (T, H) and x.grad.dtype == torch.bfloat16
    assert w.grad.shape == (T, K) and w.grad.dtype == torch.float32


def test_deepep_refuses_what_the_library_refuses(group):
    from capture_megatron.emulate.gpu.deepep import Buffer

    with pytest.raises(AssertionError):
        Buffer.set_num_sms(21)
    with pytest.raises(ValueError):
        Buffer.get_dispatch_config(12)


def _probe(dispatcher: str, backend: str, **routing):
    from capture_megatron.config import Kernels
    from capture_megatron.features.moe import Experts
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import ExpertsProbe, Probe, ProbeShape, Variant

    experts = Experts(
        num_experts=4, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
        moe_flex_dispatcher_backend=backend, moe_grouped_gemm=True, moe_aux_loss_coeff=0.01,
        moe_router_dtype="fp32", routing_bound=True, **routing,
    )  # fmt: skip
    variant = Variant("bf16", "none", True, True, "RMSNorm", "rope", False, False, True)
    variant = dataclasses.replace(variant, moe=ExpertsProbe(experts, 2, 1, "imbalance"))
    shape = ProbeShape(2, 128, 128, 4, 4, 32, 256, 256, 2)
    kernels = Kernels(moe_permute_fusion=True)
    return run_probes([Probe(variant, shape, "middle", 1)], "fake-cuda", kernels, progress=False)[0]


@pytest.mark.slow
def test_deepep_forecast_against_alltoall_at_balanced_routing():
    """One MoE layer (4 experts, top-2, EP 2) at balanced routing on the GPU kernel set: alltoall
    padded to capacity 1, DeepEP dropless at the forecast factor 1 (megatron-core does not pad
    it), float32 routing probabilities. Expected: the same weights, gradients, optimizer state
    and backward peak; saved activations within 2% (DeepEP's dispatcher keeps its multi-hot
    routing map and top-k tensors where alltoall keeps its permutation indices); no routing
    state beyond the step for DeepEP (the handle is released by combine) where alltoall keeps
    its permutation map."""
    padded = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    a2a = _probe("alltoall", "deepep", **padded)
    deep = _probe("flex", "deepep", moe_imbalance_factor=1.0)
    for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "backward_peak"):
        assert getattr(deep, name) == getattr(a2a, name), name
    assert abs(deep.saved_bytes - a2a.saved_bytes) <= 0.02 * a2a.saved_bytes
    assert deep.routing_state_bytes == 0 < a2a.routing_state_bytes
