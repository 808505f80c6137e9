"""Transformer Engine's fused MoE router kernels (--moe-router-fusion) on the fake-cuda device.

megatron-core's moe_utils.topk_routing_with_score_function, compute_routing_scores_for_aux_loss
and switch_load_balancing_loss_func call TE's fused_topk_with_score_function,
fused_compute_score_for_moe_aux_loss and fused_moe_aux_loss when config.moe_router_fusion is set.
TE 5671fd36 (transformer_engine/pytorch/router.py, csrc/extensions/router.cpp) allocates, for
[tokens, experts] logits:

- top-k (`FusedTopkScoreFunction`, router.cpp:41-47): probs [tokens, experts] in the logits'
  dtype, a bool routing map and an intermediate [tokens, experts] in the logits' dtype (the
  scores); keeps the routing map and the intermediate; backward allocates the logits' gradient;
- aux-loss scores (`FusedComputeScoresForMoEAuxLoss`, router.cpp:107-112): scores, a bool routing
  map and an intermediate, each [tokens, experts]; keeps the intermediate;
- aux loss (`FusedAuxLoss`, router.cpp:156-175): a scalar loss and an fp32 scalar; keeps that
  scalar and tokens_per_expert; backward allocates the probabilities' gradient [tokens, experts].
Megatron's unfused code keeps instead what its softmax / sigmoid, top-k, scatter and division
save (an fp32 softmax, the top-k indices, ...). On real tensors these functions compute
megatron's own (unfused) values; on fake tensors they only allocate.
"""

from __future__ import annotations

import torch

from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import is_fake


def _empty(logits: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=dtype or logits.dtype, device=logits.device)


def _grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of megatron's unfused computation kept on ctx (real tensors)."""
    return torch.autograd.grad(ctx.got, ctx.leaf, grad.to(ctx.got.dtype), retain_graph=True)[0]


def _unfused(name: str):
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, name)


class TopkScore(torch.autograd.Function):
    """TE's FusedTopkScoreFunction."""

    @staticmethod
    def forward(ctx, logits, kwargs):
        """(probs, routing map)."""
        probs, routing_map, scores = _empty(logits), _empty(logits, torch.bool), _empty(logits)
        if not is_fake(logits):
            with torch.enable_grad():
                leaf = logits.detach().requires_grad_()
                got, got_map = _unfused("topk_routing_with_score_function")(leaf, **kwargs)
            probs.copy_(got.detach()), routing_map.copy_(got_map)
            ctx.leaf, ctx.got = leaf, got
        ctx.save_for_backward(routing_map, scores)
        ctx.mark_non_differentiable(routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, grad_probs, _):
        """The logits' gradient."""
        grad = _empty(grad_probs)
        if not is_fake(grad_probs):
            grad.copy_(_grad(ctx, grad_probs))
        return grad, None


class AuxLossScores(torch.autograd.Function):
    """TE's FusedComputeScoresForMoEAuxLoss."""

    @staticmethod
    def forward(ctx, logits, topk: int, score_function: str):
        """(routing map, scores)."""
        scores, routing_map, kept = _empty(logits), _empty(logits, torch.bool), _empty(logits)
        if not is_fake(logits):
            with torch.enable_grad():
                leaf = logits.detach().requires_grad_()
                got_map, got = _unfused("compute_routing_scores_for_aux_loss")(
                    leaf, topk, score_function
                )
            scores.copy_(got.detach()), routing_map.copy_(got_map)
            ctx.leaf, ctx.got = leaf, got
        ctx.save_for_backward(kept)
        ctx.mark_non_differentiable(routing_map)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _, grad_scores):
        """The logits' gradient."""
        grad = _empty(grad_scores)
        if not is_fake(grad_scores):
            grad.copy_(_grad(ctx, grad_scores))
        return grad, None, None


class AuxLoss(torch.autograd.Function):
    """TE's FusedAuxLoss (megatron's switch load-balancing loss)."""

    @staticmethod
    def forward(ctx, probs, tokens_per_expert, total, experts, topk, coeff):
        """The scalar loss."""
        loss = torch.empty((), dtype=probs.dtype, device=probs.device)
        const = torch.empty((), dtype=torch.float32, device=probs.device)
        scale = experts * coeff / (topk * total * total)
        if not is_fake(probs):
            loss.copy_(torch.sum(probs.sum(0) * tokens_per_expert) * scale)
            const.fill_(scale)
        ctx.save_for_backward(const, tokens_per_expert)
        ctx.shape = probs.shape
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """The probabilities' gradient: tokens_per_expert x scale for every row."""
        const, tokens_per_expert = ctx.saved_tensors
        grad = torch.empty(ctx.shape, dtype=grad_loss.dtype, device=grad_loss.device)
        if not is_fake(grad_loss):
            grad.copy_((tokens_per_expert * const * grad_loss).expand(ctx.shape))
        return grad, None, None, None, None, None


def fused_topk_with_score_function(logits, topk, use_pre_softmax=False, num_groups=None,
                                   group_topk=None, scaling_factor=None, score_function="softmax",
                                   expert_bias=None):  # fmt: skip
    """TE's fused_topk_with_score_function."""
    kwargs = dict(
        topk=topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling_factor, score_function=score_function, expert_bias=expert_bias,
    )  # fmt: skip
    return TopkScore.apply(logits, kwargs)


def fused_compute_score_for_moe_aux_loss(logits, topk, score_function):
    """TE's fused_compute_score_for_moe_aux_loss: (routing map, scores)."""
    return AuxLossScores.apply(logits, topk, score_function)


def fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    """TE's fused_moe_aux_loss."""
    return AuxLoss.apply(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)


def install() -> None:
    """Give megatron's moe_utils TE's fused router kernels (idempotent)."""
    from megatron.core.transformer.moe import moe_utils

    why = "fake-cuda kernel set: TE's fused router kernels"
    patches.patch(moe_utils, "HAVE_TE", True, why)
    for name, fn in (
        ("fused_topk_with_score_function", fused_topk_with_score_function),
        ("fused_compute_score_for_moe_aux_loss", fused_compute_score_for_moe_aux_loss),
        ("fused_moe_aux_loss", fused_moe_aux_loss),
    ):
        patches.patch(moe_utils, name, fn, why, adds=True)  # bound only with TE
