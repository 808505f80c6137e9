"""--moe-permute-fusion and --moe-router-fusion on the GPU kernel set: the emulated Transformer
Engine kernels compute what megatron-core's unfused code computes (values and gradients) and keep,
tensor by tensor, what TE 5671fd36's autograd functions save."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capture_megatron.emulate.gpu import permute, router

T, E, H, K = 12, 4, 8, 2


def _routing(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    top = logits.topk(K, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(logits, -1) * routing_map
    return logits, routing_map, probs


def _saved(t: torch.Tensor) -> list[torch.Tensor]:
    return [x for x in t.grad_fn.saved_tensors if x is not None]


def test_fused_permute_and_unpermute_match_megatron_and_keep_the_row_id_map():
    from megatron.core.transformer.moe import moe_utils

    _, routing_map, probs = _routing()
    tokens = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    probs = probs.requires_grad_()
    n = int(routing_map.sum())
    want = moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=n)
    out, got_probs, row_id_map = permute.moe_permute_with_probs(tokens, probs, routing_map, n)
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(got_probs, want[1])
    assert row_id_map.dtype == torch.int32 and tuple(row_id_map.shape) == (T, 2 * E + 1)
    assert [x.data_ptr() for x in _saved(out)] == [row_id_map.data_ptr()]
    back = permute.moe_unpermute(out * 2, row_id_map, restore_shape=tokens.shape)
    ref = moe_utils.unpermute(want[0] * 2, want[2], tokens.shape, routing_map=routing_map)
    torch.testing.assert_close(back, ref)
    assert [x.data_ptr() for x in _saved(back)] == [row_id_map.data_ptr()]
    weights = torch.randn(T, H, dtype=torch.float64)
    got = torch.autograd.grad(((back * weights).sum() + got_probs.sum()), (tokens, probs))
    ref_grads = torch.autograd.grad(((ref * weights).sum() + want[1].sum()), (tokens, probs))
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a, b)


def test_fused_chunk_sort_matches_megatron_and_keeps_an_int32_map():
    from megatron.core.transformer.moe import moe_utils

    tokens = torch.randn(10, H, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(10, dtype=torch.float64, requires_grad=True)
    splits, order = torch.tensor([3, 2, 4, 1]), torch.tensor([2, 0, 3, 1])
    out, got_probs = permute.moe_sort_chunks_by_index_with_probs(tokens, probs, splits, order)
    want, want_probs = moe_utils.sort_chunks_by_idxs(tokens, splits, order, probs=probs)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(got_probs, want_probs)
    (kept,) = _saved(out)
    assert kept.dtype == torch.int32 and tuple(kept.shape) == (10,)
    weights = torch.randn(10, H, dtype=torch.float64)
    got = torch.autograd.grad((out * weights).sum() + (got_probs * 3).sum(), (tokens, probs))
    ref = torch.autograd.grad((want * weights).sum() + (want_probs * 3).sum(), (tokens, probs))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_fused_router_matches_megatron_and_keeps_map_and_scores(score_function):
    """TE's FusedTopkScoreFunction keeps the bool routing map and a [tokens, experts]
    intermediate in the logits' dtype; FusedComputeScoresForMoEAuxLoss keeps the intermediate;
    FusedAuxLoss an fp32 scalar and tokens_per_expert."""
    from megatron.core.transformer.moe import moe_utils

    logits = _routing(1)[0].requires_grad_()
    kwargs = dict(topk=K, use_pre_softmax=False, score_function=score_function)
    probs, routing_map = router.fused_topk_with_score_function(logits, **kwargs)
    want, want_map = moe_utils.topk_routing_with_score_function(logits, **kwargs)
    torch.testing.assert_close(probs, want)
    assert torch.equal(routing_map, want_map)
    kept = _saved(probs)
    assert [(x.dtype, tuple(x.shape)) for x in kept] == [
        (torch.bool, (T, E)), (logits.dtype, (T, E))
    ]  # fmt: skip
    weights = torch.randn(T, E, dtype=torch.float64)
    got = torch.autograd.grad((probs * weights).sum(), logits, retain_graph=True)[0]
    ref = torch.autograd.grad((want * weights).sum(), logits, retain_graph=True)[0]
    torch.testing.assert_close(got, ref)

    got_map, scores = router.fused_compute_score_for_moe_aux_loss(logits, K, score_function)
    ref_map, ref_scores = moe_utils.compute_routing_scores_for_aux_loss(logits, K, score_function)
    assert torch.equal(got_map, ref_map)
    torch.testing.assert_close(scores, ref_scores.to(scores.dtype))
    assert [(x.dtype, tuple(x.shape)) for x in _saved(scores)] == [(logits.dtype, (T, E))]

    counts = routing_map.sum(0).to(torch.float64)
    args = dict(tokens_per_expert=counts, total_num_tokens=T, num_experts=E, topk=K)
    loss = router.fused_moe_aux_loss(probs, coeff=0.01, **args)
    ref = moe_utils.switch_load_balancing_loss_func(want, moe_aux_loss_coeff=0.01, **args)
    torch.testing.assert_close(loss, ref)
    const, tokens_per_expert = _saved(loss)
    assert const.dtype == torch.float32 and const.dim() == 0 and tokens_per_expert is counts
    got = torch.autograd.grad(loss, logits)[0]
    torch.testing.assert_close(got, torch.autograd.grad(ref, logits)[0])


@pytest.mark.slow
def test_fake_cuda_moe_layers_run_with_both_fusions():
    """An alltoall MoE layer (EP 2, grouped GEMM) runs on fake CUDA with TE's fused permutation
    and router (megatron raises without TE); the dispatcher keeps TE's int32 row_id_map
    [tokens, 2 x experts + 1] as its permutation mapping in place of the int64 sorted indices."""
    from capture_megatron.config import Kernels
    from capture_megatron.features.moe import Experts
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import ExpertsProbe, Probe, ProbeShape, Variant

    experts = Experts(
        num_experts=E, moe_router_topk=K, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True, moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True, moe_aux_loss_coeff=0.01,
    )  # fmt: skip
    variant = Variant("bf16", "selective", True, True, "RMSNorm", "rope", False, False, True)
    variant = dataclasses.replace(variant, moe=ExpertsProbe(experts, 2, 1, "exact"))
    b, s, t = 2, 128, 2
    shape = ProbeShape(b, s, 128, 4, 4, 32, 256, 256, t)
    fused = Kernels(moe_permute_fusion=True, moe_router_fusion=True)
    plain, both = (
        run_probes([Probe(variant, shape, "middle", 1)], "fake-cuda", k, progress=False)[0]
        for k in (Kernels(), fused)
    )
    tokens = s * b // t
    capacity = tokens * K // E
    row_id_map, sorted_indices = 4 * tokens * (2 * E + 1), 8 * E * capacity
    assert both.routing_state_bytes - plain.routing_state_bytes >= row_id_map - sorted_indices
    assert 0 < both.saved_bytes <= plain.saved_bytes
