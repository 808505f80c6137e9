"""megatron-core 0.16.1's mixture-of-experts layers on fake tensors (the fake-cpu and fake-cuda
profiling devices), where routing values decide shapes.

Fake tensors hold no values, so whatever megatron sizes by routing values is sized here by the
probe's routing bound: probes always pad every expert to a capacity
(--moe-pad-expert-input-to-capacity, capture_megatron.forecast.support.experts_probe), so every
expert receives exactly min(capacity, local tokens) tokens from every rank that sends to it. Real
tensors, and runs without padding, keep megatron's own code. Each patch names its call site:

1. ``transformer/moe/experts.py``: SequentialMLP.forward and TEGroupedMLP.forward split their
   tokens by ``tokens_per_expert.tolist()``. With padding the dispatchers' counts are equal: the
   patch hands megatron those counts (the rows over the local experts) as a real host tensor,
   made outside every mode (the fake counts it stands for are metered already).
2. ``transformer/moe/token_dispatcher.py``, MoEAllGatherTokenDispatcher.dispatch_postprocess:
   the gathered routing map selects the local experts' tokens with ``masked_select`` (in
   moe_utils.permute and for the local probabilities), whose output length is the number of
   selected tokens. While it runs, SelectedCount answers aten.masked_select with a tensor of the
   padded count (local experts x capacity x the TP x EP ranks sending); autograd above the mode
   still records masked_select's backward, with what it saves.
3. ``transformer/moe/router.py``, TopKRouter.sinkhorn_load_balancing: moe_utils.sinkhorn iterates
   until its error (a value) is below a tolerance. Under no_grad every iteration allocates the
   same temporaries and frees the previous ones, so one iteration holds what any number holds.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from capture_megatron.emulate import patches


class SelectedCount(TorchDispatchMode):
    """Answers aten.masked_select with `count` elements (the mask's known number of true
    entries), and the one scalar read (megatron-core 0.19's dispatch_postprocess sizes its
    permutation by tokens_per_expert.sum().item(): the same count); every other op passes
    through."""

    def __init__(self, count: int):
        super().__init__()
        self.count = count
        """Elements the mask selects."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        if func is torch.ops.aten.masked_select.default:
            src = args[0]
            return torch.empty(self.count, dtype=src.dtype, device=src.device)
        if func is torch.ops.aten._local_scalar_dense.default:
            return self.count
        return func(*args, **(kwargs or {}))


def _padded(config, tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) and bool(config.moe_pad_expert_input_to_capacity)


def padded_capacity(config, local_tokens: int) -> int:
    """Tokens each expert receives from one rank when padded to capacity (megatron's
    apply_router_token_dropping: at most all of the rank's tokens)."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    capacity = get_capacity(
        num_tokens=local_tokens * config.moe_router_topk,
        num_experts=config.num_moe_experts,
        capacity_factor=config.moe_expert_capacity_factor,
    )
    return min(capacity, local_tokens)


def _patch_token_counts(cls) -> None:
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    original = cls.forward

    def forward(self, hidden, tokens_per_expert, probs):
        if _padded(self.config, tokens_per_expert):
            n, rows = self.num_local_experts, hidden.shape[0]
            if rows % n:
                raise RuntimeError(f"{rows} padded tokens do not split over {n} local experts")
            with _disable_current_modes():  # a real host tensor, unseen by the meter: the fake
                # counts it stands for are counted already
                tokens_per_expert = torch.full((n,), rows // n, dtype=torch.long)
        return original(self, hidden, tokens_per_expert, probs)

    why = "fake tensors: padded expert inputs (capacity factor) count as on a GPU"
    patches.patch(cls, "forward", forward, why)


def _patch_allgather() -> None:
    import math

    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    original = MoEAllGatherTokenDispatcher.dispatch_postprocess

    def dispatch_postprocess(self, hidden_states, probs):
        if not _padded(self.config, hidden_states):
            return original(self, hidden_states, probs)
        local_tokens = math.prod(self.hidden_shape[:-1])
        ranks = self.routing_map.shape[0] // local_tokens
        per_expert = padded_capacity(self.config, local_tokens) * ranks
        with SelectedCount(self.num_local_experts * per_expert):
            return original(self, hidden_states, probs)

    why = "fake tensors: the allgather dispatcher's padded selection sized as on a GPU"
    patches.patch(MoEAllGatherTokenDispatcher, "dispatch_postprocess", dispatch_postprocess, why)


def one_sinkhorn_iteration(cost):
    """moe_utils.sinkhorn with its loop body run once (the allocations of any iteration; the
    convergence test reads a value)."""
    import torch

    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 0.00000001
    d1_old = d1
    d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
    d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
    error = torch.mean(torch.abs(d1_old - d1))
    del error, d1_old
    return d1 * cost * d0.unsqueeze(1)


def _patch_sinkhorn() -> None:
    from megatron.core.transformer.moe import router
    from torch._subclasses.fake_tensor import FakeTensor

    original = router.sinkhorn

    def sinkhorn(cost, tol: float = 0.0001):
        if isinstance(cost, FakeTensor):
            return one_sinkhorn_iteration(cost)
        return original(cost, tol)

    why = "fake tensors: sinkhorn's convergence loop reads a value; one iteration allocates"
    patches.patch(router, "sinkhorn", sinkhorn, why)


def apply() -> None:
    """Install the patches (idempotent)."""
    if not patches.first("moe_fake"):
        return
    from megatron.core.transformer.moe import experts

    _patch_token_counts(experts.SequentialMLP)
    _patch_token_counts(experts.TEGroupedMLP)
    _patch_allgather()
    _patch_sinkhorn()
