"""Transformer Engine's fused cross entropy (--cross-entropy-loss-fusion
--cross-entropy-fusion-impl te) on the fake-cuda device.

megatron's LanguageModule.compute_language_model_loss calls TE's parallel_cross_entropy through
megatron.core.extensions.transformer_engine.te_parallel_cross_entropy (None without TE: megatron
then raises "Trying to use a TE block when it's not present"). TE 5671fd36's CrossEntropyFunction
(transformer_engine/pytorch/cross_entropy.py:19-87) runs two Triton kernels
(pytorch/triton/cross_entropy.py cross_entropy_forward / cross_entropy_backward), which allocate:

- forward: the fp32 loss [rows], an fp32 [rows x 3] (max, sum, target logit) per row of the local
  vocabulary shard, an int64 count, and with TP > 1 the fp32 [rows x 3 x TP] all-gather of it;
  the kernel writes the logits' gradient (softmax minus one-hot) **in place into the logits** and
  the function saves them (`ctx.save_for_backward(inp.detach())`): 2 bytes per logit kept, no
  fp32 softmax;
- backward: nothing when the incoming gradient is exactly 1, else an in-place multiply; the
  gradient returned is the logits' own storage.
TECrossEntropy below allocates and keeps the same; on real tensors it computes the real loss and
gradient (tests check them against torch).
"""

from __future__ import annotations

import torch

from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import is_fake


def _world(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


class TECrossEntropy(torch.autograd.Function):
    """TE's CrossEntropyFunction (label smoothing 0, no loss reduction, ignore index -100)."""

    @staticmethod
    def forward(ctx, logits, target, group):
        """Per-token fp32 loss; the logits overwritten with their gradient and kept."""
        rows, vocab = logits.numel() // logits.shape[-1], logits.shape[-1]
        rank, world = _world(group)
        loss = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        stats = torch.zeros(rows * 3, dtype=torch.float32, device=logits.device)
        torch.zeros(1, dtype=torch.int64, device=logits.device)  # n_non_ignore, freed
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        gathered = stats
        if world > 1:
            gathered = torch.zeros(rows * 3 * world, dtype=torch.float32, device=logits.device)
        if not is_fake(logits):
            _compute(logits.view(rows, vocab), target.reshape(rows), loss, stats, rank, group)
        del gathered
        ctx.save_for_backward(logits.detach())
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        """The saved logits (holding the gradient), scaled in place by the incoming gradient."""
        (grad,) = ctx.saved_tensors
        if not is_fake(grad):
            grad.mul_(grad_output.reshape(*grad_output.shape, 1).to(grad.dtype))
        return grad, None, None


def _compute(x, target, loss, stats, rank: int, group) -> None:
    """The loss and, in place in `x`, the gradient of each row (over the vocabulary shards)."""
    vocab = x.shape[-1]
    xf = x.float()
    local = target - rank * vocab
    inside = (local >= 0) & (local < vocab)
    picked = xf.gather(1, local.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1) * inside
    high = xf.max(dim=1).values
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(high, torch.distributed.ReduceOp.MAX, group=group)
        torch.distributed.all_reduce(picked, group=group)
    total = (xf - high.unsqueeze(1)).exp().sum(1)
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total, group=group)
    stats.view(-1, 3).copy_(torch.stack([high, total, picked], 1))
    loss.copy_(total.log() + high - picked)
    grad = (xf - high.unsqueeze(1)).exp() / total.unsqueeze(1)
    grad[inside.nonzero().squeeze(1), local[inside]] -= 1.0
    x.copy_(grad.to(x.dtype))


def te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable: bool = False):
    """megatron.core.extensions.transformer_engine.te_parallel_cross_entropy on TECrossEntropy."""
    del is_cg_capturable
    return TECrossEntropy.apply(logits, labels, tp_group)


def install() -> None:
    """Give megatron's language module TE's cross entropy (idempotent)."""
    from megatron.core.models.common.language_module import language_module

    why = "fake-cuda kernel set: TE's fused cross entropy (--cross-entropy-fusion-impl te)"
    patches.patch(language_module, "te_parallel_cross_entropy", te_parallel_cross_entropy, why)
