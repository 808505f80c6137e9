"""Process groups for probes: this process is rank 0 of a `tp x dp` job of torch's fake backend
(EP x ETP expert groups carved from it for MoE probes).

The fake backend (torch.testing's FakeStore + backend "fake") completes every collective without
moving data, so one process builds and runs exactly what TP/DP rank 0 of a real job holds — the
buffers megatron allocates for all-gathers and reduce-scatters included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def fake_job(
    tp: int,
    dp: int,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
    seed: int = 1234,
    instances: int = 1,
) -> Iterator[None]:
    """Initialise torch.distributed (fake, world tp*cp*dp, rank 0) and megatron's parallel_state
    (with `ep` x `etp` expert groups, etp None: TP; `cp` context-parallel ranks; `instances`
    distributed-optimizer instances)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp * dp)
    original_gather = torch.distributed.all_gather_object

    # Object collectives pickle through real tensors (and read them back with .item(), which fake
    # tensors cannot answer). Every rank of the symmetric fake job holds the same object, so the
    # gather is this rank's object repeated — what megatron's optimizer set-up asks it for.
    def gather(object_list: list[Any], obj: Any, group: Any = None) -> None:
        object_list[:] = [obj] * len(object_list)

    torch.distributed.all_gather_object = gather
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=1,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            num_distributed_optimizer_instances=instances,
            create_gloo_process_groups=False,
        )
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        torch.distributed.all_gather_object = original_gather
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
