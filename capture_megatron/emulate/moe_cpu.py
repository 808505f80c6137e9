"""Run megatron-core 0.16.1's mixture-of-experts layers without CUDA (the CPU kernel set).

Run-time patches in the style of capture_megatron.emulate.cpu_compat (which applies them, only
when CUDA is absent); nothing in site-packages is edited. Each names the megatron call sites it
serves:

1. ``transformer/moe/moe_utils.py`` defines ``te_general_gemm`` only when Transformer Engine
   imports, but the router's gating GEMM reads it unconditionally: without TE it is set to None
   (capture_megatron.emulate.te_absent, which every device applies, a GPU included).
2. ``transformer/moe/token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher``: the constructor creates
   a class-wide ``torch.cuda.Stream()`` (a CPU build of torch refuses to instantiate it), and
   ``_maybe_dtoh_and_synchronize`` copies the routing counts to the host on that side stream, with
   ``torch.cuda.current_stream`` / ``stream`` / ``record_event``. On CPU every tensor is already a
   host tensor and nothing is asynchronous: the stream is a placeholder that is never used, and
   the method does the one thing that still matters, at the same point in the dispatch: the split
   sizes (``input_splits``, ``output_splits``, ``output_splits_tp``) become numpy arrays, as
   ``maybe_move_tensor_to_cpu(as_numpy=True)`` makes them on a GPU.
3. Those split sizes reach ``torch.distributed.all_to_all_single`` through
   ``tensor_parallel/mappings._AllToAll`` (``token_dispatcher.all_to_all``); c10d takes sequences
   of ints and refuses tensors. The dispatcher's ``all_to_all`` is wrapped to hand it lists.

4. With TP > 1 the alltoall dispatcher gathers the tokens its TP peers received over the TP group
   and reduce-scatters them back, in unequal parts (``output_split_sizes`` /
   ``input_split_sizes`` of ``tensor_parallel/mappings._gather_along_first_dim`` and
   ``_reduce_scatter_along_first_dim``, from ``gather_from_sequence_parallel_region`` and
   ``reduce_scatter_to_sequence_parallel_region``). Gloo's all_gather refuses tensors of unequal
   size ("invalid tensor size") where NCCL takes them. On CPU the unequal gather pads every part
   to the largest, all-gathers and drops the padding; the unequal reduce-scatter all-reduces the
   whole input and keeps this rank's part (the same sums; the transient buffers are larger than
   NCCL's). Equal splits keep megatron's own path.
What fake tensors need (token counts, masked selects, sinkhorn's loop) is in
capture_megatron.emulate.moe_fake.

What cannot run on the CPU kernel set is refused before training (capture_megatron.megatron.moe):
--moe-grouped-gemm (TE's GroupedMLP), the flex dispatcher (DeepEP / HybridEP), biases on the
local spec's experts.
"""

from __future__ import annotations

from capture_megatron.emulate import patches, te_absent


class HostStream:
    """Stands in for the alltoall dispatcher's class-wide CUDA stream on CPU; never used (the
    method that would use it is replaced)."""


def _as_list(sizes):
    """Split sizes as the list of ints all_to_all_single takes (None stays None)."""
    if sizes is None or isinstance(sizes, list):
        return sizes
    return [int(n) for n in sizes.tolist()]


def host_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on the host: at the dispatcher's
    device-to-host point the split sizes become numpy arrays (the GPU path's as_numpy copy); no
    stream, no event, nothing to wait for."""
    import torch

    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.detach().cpu().numpy())
    return tokens_per_expert


def uneven_gather(input_, group, sizes: list[int]):
    """All-gather along the first dimension when the ranks hold `sizes` rows (gloo cannot gather
    unequal tensors): pad to the largest, gather, drop the padding."""
    import torch

    most, world = max(sizes), len(sizes)
    padded = input_.new_zeros((most, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = input_.new_empty((most * world, *input_.shape[1:]))
    torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
    return torch.cat([gathered[i * most : i * most + n] for i, n in enumerate(sizes)])


def uneven_reduce_scatter(input_, group, sizes: list[int]):
    """Reduce-scatter along the first dimension in parts of `sizes` rows: the sum over the group
    of this rank's part (all-reduce of the whole input, then this rank's rows)."""
    import torch

    total = input_.clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]].clone()


def _patch_uneven_collectives() -> None:
    """Route megatron's unequal first-dimension gathers and reduce-scatters to the gloo-capable
    versions above (equal splits keep megatron's own functions)."""
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return uneven_gather(input_, group, _as_list(output_split_sizes))

    def reduce_scatter_along_first_dim(
        input_, group, input_split_sizes=None, use_global_buffer=False
    ):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        return uneven_reduce_scatter(input_, group, _as_list(input_split_sizes))

    why = "patch 6: the alltoall dispatcher's uneven SP gathers / scatters on gloo"
    patches.patch(mappings, "_gather_along_first_dim", gather_along_first_dim, why)
    patches.patch(mappings, "_reduce_scatter_along_first_dim", reduce_scatter_along_first_dim, why)


def apply() -> None:
    """Install the patches (idempotent)."""
    if not patches.first("moe_cpu"):
        return
    from megatron.core.transformer.moe import token_dispatcher

    te_absent.apply()
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    why = "patch 6: the alltoall dispatcher's device-to-host stream, on the host"
    if dispatcher.cuda_dtoh_stream is None:
        # a host stand-in with the two methods the dispatcher calls on its stream
        patches.patch(dispatcher, "cuda_dtoh_stream", HostStream(), why)
    patches.patch(dispatcher, "_maybe_dtoh_and_synchronize", host_dtoh_and_synchronize, why)
    original = token_dispatcher.all_to_all

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, **more):
        # more: 0.19's use_nccl_stream (async all_to_all_single waited at once: the same on gloo)
        sizes = _as_list(output_split_sizes_), _as_list(input_split_sizes)
        return original(group, input_, *sizes, **more)

    why = "patch 6: the alltoall dispatcher's split sizes as lists (gloo's all_to_all)"
    patches.patch(token_dispatcher, "all_to_all", all_to_all, why)
    _patch_uneven_collectives()
