"""Make gloo release a blocking collective's tensors where the collective returns (CPU training).

ProcessGroupGloo runs each collective on one of its worker threads. A blocking call
(`async_op=False`) returns to the caller as soon as the work is marked complete, but the worker
drops its own references to the work's tensors a moment later. When the caller has already let
go of a temporary it passed (megatron's alltoall token dispatcher hands `all_to_all_single` the
permuted tokens and probabilities and drops them as soon as it returns), the storage is freed by
the worker thread at a point that races with the caller's next allocations. Measured on the CPU
EP2 MoE run with full recompute: identical runs peaked up to ~130 KiB (two hidden states) apart,
the release landing on gloo's thread in about one dispatch in five.

`install()` wraps torch.distributed's blocking collectives: after the call returns, the caller
waits (yielding the GIL) until every tensor it passed is back at the reference count it had
before the call, i.e. until the worker has dropped the work, at most `SETTLE_SECONDS`. The
collective's result is unchanged; only when its temporaries die becomes deterministic: where the
program's last reference drops, as with the fake process group the profiler uses and as
megatron's code reads. Asynchronous calls (`async_op=True`, the pipeline's isend/irecv) are left
as they are: their tensors outlive the wait in megatron's schedules. Callers that bound a
collective to a name before `install()` keep the original, except megatron-core's own aliases of
the all-gather and reduce-scatter (ALIASES), which are rebound.

Used only for CPU training on gloo (capture_megatron.emulate.cpu_compat on the cpu device); on a
GPU, NCCL is not touched.
"""

from __future__ import annotations

import functools
import inspect
import time

import torch
from torch.utils._pytree import tree_leaves

from capture_megatron.emulate import patches

SETTLE_SECONDS = 2.0
"""The longest a caller waits for gloo's worker to drop a collective's tensors (then it goes on)."""

BLOCKING = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "reduce",
    "reduce_scatter",
)
"""torch.distributed's collectives that megatron calls blocking with temporaries."""


def settle(tensors: list, counts: list[int]) -> bool:
    """Wait until each tensor's reference count is back to `counts` (the worker dropped the work);
    False if it is not within SETTLE_SECONDS."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while any(t._use_count() > n for t, n in zip(tensors, counts)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0)  # releases the GIL: the worker needs it to free Python-owned storages
    return True


def settled(collective):
    """`collective` that, when blocking, returns only once gloo has let go of its tensors. Should
    the references not drop within SETTLE_SECONDS (something else keeps them), this collective is
    no longer waited for: each collective slows a run down at most once."""
    signature = inspect.signature(collective)
    waiting = True

    @functools.wraps(collective)
    def call(*args, **kwargs):
        nonlocal waiting
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("async_op") or not waiting:
            return collective(*args, **kwargs)
        tensors = [t for t in tree_leaves(list(bound.arguments.values())) if torch.is_tensor(t)]
        counts = [t._use_count() for t in tensors]  # type: ignore[attr-defined]  # private, no stub
        result = collective(*args, **kwargs)
        waiting = settle(tensors, counts)
        return result

    call.__wrapped_for_gloo__ = True  # type: ignore[attr-defined]  # our marker on the wrapper
    return call


ALIASES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.multi_token_prediction",
)
"""megatron-core modules that bind torch.distributed's all-gather / reduce-scatter to a name at
import (`dist_all_gather_func`, `dist_reduce_scatter_func`): the sequence-parallel gathers and
scatters of activations go through them. Those imported before `install()` are rebound; those
imported after it bind the wrapped functions themselves."""


def install() -> None:
    """Wrap torch.distributed's blocking collectives and megatron-core's aliases of them
    (idempotent)."""
    import sys

    import torch.distributed as dist

    if not patches.first("gloo_settle"):
        return
    wrapped = {}
    for name in BLOCKING:
        original = getattr(dist, name)
        wrapped[original] = settled(original)
        why = "patch 8: blocking collectives return once gloo dropped their tensors"
        patches.patch(dist, name, wrapped[original], why)
    for module in filter(None, map(sys.modules.get, ALIASES)):  # imported later: bind wrapped
        for attr in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            alias = getattr(module, attr, None)
            if alias in wrapped:
                why = "patch 8: megatron-core's alias of torch.distributed's collective"
                patches.patch(module, attr, wrapped[alias], why)
