"""Megatron-FSDP's communication in the step-time model (--use-megatron-fsdp,
--data-parallel-sharding-strategy). Pure Python.

megatron-core 0.16.1 (distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py): no_shard reduces the
gradients once per step like DDP; optim shards the optimizer state (gradients reduce-scattered
and parameters all-gathered once per step, as the distributed optimizer does); optim_grads also
shards the gradients, so every micro-batch's backward reduce-scatters each layer's gradients
("with gradient-sharding strategies, gradient reduction occurs on every backward
propagation"); optim_grads_params also shards the parameters, so every micro-batch all-gathers
each layer's parameters before its forward and again before its backward. The per-layer
collectives are prefetched (the next layer's gather runs during this layer's compute, the
reduce-scatter after it), so a layer exposes what its own compute does not cover. Dense
parameters go over the DP x CP group, routed experts over the expert-data-parallel group.

The settings are the plan's DdpOptions.fsdp (capture_megatron.features.fsdp, which checks the
strategy is one of Megatron's).
"""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan, dtype_bytes
from capture_megatron.steptime.kernels import Setting, ring


def strategy(plan: ParallelPlan) -> str:
    """The plan's Megatron-FSDP sharding strategy ('' without Megatron-FSDP; Megatron-LM's default
    no_shard when none is given)."""
    fsdp = plan.ddp.fsdp
    if not fsdp.use_megatron_fsdp:
        return ""
    return fsdp.data_parallel_sharding_strategy


def per_layer(
    s: Setting,
    shape: ModelShape,
    plan: ParallelPlan,
    params: tuple[float, float],
    compute: tuple[float, float],
) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one layer's per-micro-batch Megatron-FSDP
    collectives for its (dense, routed-expert) `params` on one GPU, behind its (forward,
    backward) `compute`."""
    kind = strategy(plan)
    if kind not in ("optim_grads", "optim_grads_params"):
        return 0.0, 0.0
    dense, expert = params
    dp = plan.dp * plan.cp
    groups = ((dense, dp, plan.tp), (expert, plan.expert_dp, plan.ep * plan.expert_tp))
    grad = dtype_bytes(plan.ddp.grad_dtype(shape.dtype))
    gather = reduce = 0.0
    for n, ranks, stride in groups:
        if n <= 0 or ranks <= 1:
            continue
        bw = s.hw.link_bytes_per_s(0, ranks, stride)
        gather += ring(s, n * dtype_bytes(shape.dtype), ranks, bw)
        reduce += ring(s, n * grad, ranks, bw)
    if kind == "optim_grads":
        return 0.0, max(0.0, reduce - compute[1])
    return max(0.0, gather - compute[0]), max(0.0, gather + reduce - compute[1])


def step_collectives(plan: ParallelPlan) -> tuple[int, bool] | None:
    """(passes of the step's gradient reduce: 0 none, 1 reduce-scatter, 2 all-reduce; whether the
    step all-gathers the parameters) under Megatron-FSDP, None without it."""
    kind = strategy(plan)
    if not kind:
        return None
    return {
        "no_shard": (2, False),
        "optim": (1, True),
        "optim_grads": (0, True),
        "optim_grads_params": (0, False),
    }[kind]


def shards_optimizer(plan: ParallelPlan) -> bool:
    """Whether the optimizer state is sharded over the data-parallel ranks (the distributed
    optimizer, or Megatron-FSDP with any sharding)."""
    kind = strategy(plan)
    return plan.distributed_optimizer if not kind else kind != "no_shard"
