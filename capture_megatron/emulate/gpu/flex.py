"""HybridEP, the flex dispatcher's --moe-flex-dispatcher-backend hybridep, on the fake-cuda device.

megatron-core 0.16.1's fused_a2a.py builds `HybridEPBuffer(group=, hidden_dim=,
max_num_of_tokens_per_rank=, num_local_experts=, num_sms_dispatch_api=, num_sms_combine_api=)`
and its quantized-dispatch switch (asserted off) once (init_hybrid_ep_buffer) and calls its
`dispatch_with_permute` /
`combine_with_unpermute` from HybridEPDispatch / HybridEPCombine. This module is that class, after
deepseek-ai/DeepEP's hybrid-ep branch at eb9cee7de5a24193bf09500668d3a619d3d3f3fb (the commit
Megatron-LM core_v0.16.1's docker/Dockerfile.ci.dev installs): deep_ep/hybrid_ep_buffer.py and
the tensors its C++ runtime returns through torch (csrc/hybrid_ep/executor/executor.cu
metadata_preprocess_core and dispatch_postprocess, extension/permute.cu permute_preprocessing
and permute_launcher, hybrid_ep.cu combine_with_unpermute):

- dispatch_with_permute without a handle (forward) allocates the metadata the handle keeps:
  sparse_to_dense_map int32 [tokens x nodes, ranks per domain], rdma_to_attn_map bool
  [ceil16(tokens), nodes], attn_to_rdma_map bool [tokens, nodes - 1], the dispatched-token count
  int32 [1] (on the GPU when non_blocking, else pinned host memory), local_expert_routing_map
  bool [tokens x group, local experts], row_id_map int32 [max tokens x group + pad_multiple,
  local experts] and an overflow flag int32 [1]; transiently the all-gathered routing map bool
  [tokens x group, experts] (torch.distributed.all_gather_into_tensor: custom all-gather is off
  by default) and two int32 workspaces [ceil(rows / 256), local experts], [ceil(rows / 65536),
  local experts]; it returns the permuted tokens [num_permuted_tokens, hidden] in the input's
  dtype, their probabilities float32 [num_permuted_tokens] (with probabilities), no scaling
  factors (megatron-core never dispatches quantized tokens), tokens per expert int64 [local
  experts] and the handle;
- with a handle (the backward of combine) it reuses the handle's maps and returns only the
  permuted tokens (tokens per expert undefined: None);
- combine_with_unpermute returns the combined tokens [tokens, hidden] in the input's dtype and,
  with probabilities (the backward of dispatch), float32 [tokens, experts].
HybridEP's communication buffers come from cudaMalloc / its own allocator, not torch's: they are
counted outside the allocator (features.dispatch.hybridep_buffer_bytes), never here.

The results of a collective depend on the other ranks' tokens, which a one-process fake job does
not have: the emulation allocates exactly what the library returns and keeps (the handle lives
where megatron keeps it: the autograd contexts and the dispatcher, until the dispatch's backward)
and leaves values undefined (torch.empty), on real tensors as on fake ones. Never called on a
real GPU or for CPU runs.
"""

from __future__ import annotations

import logging

import torch

from capture_megatron.emulate import patches
from capture_megatron.features.dispatch import MIN_TOKENS

NVLINK_DOMAIN = 8
"""GPUs per NVLink domain HybridEP detects (allocator.detect_accessible_ranks): an HGX node's 8.
Only the small metadata maps of the handle depend on it (a group that is not whole domains of 8
counts as one domain here; the planner checks the hardware's domains,
capture_megatron.features.dispatch.flex_problems)."""


FLOAT32_WARNINGS = ("HybridEP only supports float32 probs", "DeepEP only supports float32 probs")
"""megatron-core's per-dispatch warnings about bfloat16 routing probabilities."""


class HybridEPBuffer:
    """deep_ep.HybridEPBuffer (hybrid_ep_buffer.py at eb9cee7) as megatron-core 0.16.1 calls it."""

    def __init__(
        self,
        group,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        num_sms_dispatch_api: int | None = None,
        num_sms_combine_api: int | None = None,
        **switches: object,
    ):
        self.group = group
        """The expert TP x EP process group."""
        self.group_size = group.size()
        """Ranks of the group."""
        if self.group_size < 2:
            raise ValueError("The hybrid-ep kernel should be used with at least 2 ranks")
        ranks = min(NVLINK_DOMAIN, self.group_size)
        self.ranks_per_domain = self.group_size if self.group_size % ranks else ranks
        """Ranks in one NVLink domain (HybridEP's num_of_ranks_per_node)."""
        self.num_of_nodes = self.group_size // self.ranks_per_domain
        """NVLink domains the group spans."""
        self.hidden_dim = hidden_dim
        """Hidden size the buffers were made for."""
        self.max_num_of_tokens_per_rank = max(max_num_of_tokens_per_rank, MIN_TOKENS)
        """Tokens per rank the buffers hold (grown by a larger dispatch, as update_template_config
        does)."""
        self.num_local_experts = num_local_experts
        """Experts per rank."""
        if any(switches.values()):  # megatron-core 0.16.1 passes its quantized dispatch, off
            on = sorted(name for name, value in switches.items() if value)
            raise ValueError(f"the GPU kernel set does not emulate HybridEP with {on} on")

    def _metadata(self, tokens: int, experts: int, device, non_blocking: bool):
        """metadata_preprocessing's outputs (and its transient all-gathered routing map)."""
        gathered = torch.empty((tokens * self.group_size, experts), dtype=torch.bool, device=device)
        del gathered  # all_gather_into_tensor's output, read by the preprocessing kernel only
        nodes, ranks = self.num_of_nodes, self.ranks_per_domain
        count_device = device if non_blocking else "cpu"
        return (
            torch.empty((tokens * nodes, ranks), dtype=torch.int32, device=device),
            torch.empty((-(-tokens // 16) * 16, nodes), dtype=torch.bool, device=device),
            torch.empty((tokens, nodes - 1), dtype=torch.bool, device=device),
            torch.empty(1, dtype=torch.int32, device=count_device),
            torch.empty(
                (tokens * self.group_size, self.num_local_experts), dtype=torch.bool, device=device
            ),
        )

    def _permute_metadata(self, device, pad_multiple: int, non_blocking: bool):
        """permute_preprocessing's outputs (row_id_map, tokens per expert, overflow flag)."""
        rows = self.max_num_of_tokens_per_rank * self.group_size
        local = self.num_local_experts
        row_id_map = torch.empty((rows + pad_multiple, local), dtype=torch.int32, device=device)
        tokens_per_expert = torch.empty(
            local, dtype=torch.int64, device=device if non_blocking else "cpu"
        )
        overflow = torch.empty(1, dtype=torch.int32, device=device)
        first = -(-rows // 256)
        workspaces = [
            torch.empty((n, local), dtype=torch.int32, device=device)
            for n in (first, -(-first // 256))
        ]
        del workspaces
        return row_id_map, tokens_per_expert, overflow

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        scaling_factor: torch.Tensor | None = None,
        num_of_experts_per_rank: int | None = None,
        pad_multiple: int | None = None,
        num_permuted_tokens: int | None = None,
        handle: tuple | None = None,
        non_blocking: bool = False,
        **_: object,
    ):
        """(permuted tokens, permuted probabilities or None, None, tokens per expert or None,
        handle)."""
        del scaling_factor, num_of_experts_per_rank
        tokens, _hidden = hidden.shape
        device, pad = hidden.device, pad_multiple or 0
        if num_permuted_tokens is None or num_permuted_tokens < 0:
            raise ValueError(
                "the GPU kernel set's HybridEP needs num_permuted_tokens (megatron-core passes it "
                "with padded expert inputs, as every forecast pads)"
            )
        tokens_per_expert = None
        if handle is None:
            if routing_map is None or routing_map.dtype != torch.bool:
                raise ValueError("dispatch_with_permute needs a bool routing map or a handle")
            self.max_num_of_tokens_per_rank = max(self.max_num_of_tokens_per_rank, tokens)
            meta = self._metadata(tokens, routing_map.shape[-1], device, non_blocking)
            row_id_map, tokens_per_expert, overflow = self._permute_metadata(
                device, pad, non_blocking
            )
        else:  # (5 metadata maps, row_id_map, tokens, template config, overflow flag)
            meta, row_id_map, overflow = handle[:5], handle[5], handle[8]
        out = torch.empty((num_permuted_tokens, hidden.shape[1]), dtype=hidden.dtype, device=device)
        out_probs = None
        if probs is not None:
            out_probs = torch.empty(num_permuted_tokens, dtype=torch.float32, device=device)
        handle = (*meta, row_id_map, tokens, None, overflow)
        return out, out_probs, None, tokens_per_expert, handle

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: torch.Tensor | None = None,
        handle: tuple | None = None,
        pad_multiple: int | None = None,
        **_: object,
    ):
        """(combined tokens [tokens, hidden], combined probabilities [tokens, experts] or
        None)."""
        del pad_multiple
        if handle is None:
            raise ValueError("The handle is necessary in the combine pass.")
        if hidden.element_size() != 2:
            raise ValueError("HybridEP combines 16-bit tokens only")
        tokens = handle[6]
        out = torch.empty((tokens, self.hidden_dim), dtype=hidden.dtype, device=hidden.device)
        out_probs = None
        if probs is not None:
            experts = self.num_local_experts * self.group_size
            out_probs = torch.empty((tokens, experts), dtype=torch.float32, device=hidden.device)
        return out, out_probs


def hybrid_ep_dispatch(
    x,
    routing_map,
    probs,
    group,
    num_local_experts,
    num_sms_dispatch_api=24,
    num_sms_combine_api=24,
    num_permuted_tokens=None,
    pad_multiple=None,
):
    """megatron-core 0.16.1's fused_a2a.hybrid_ep_dispatch (defined there only when deep_ep
    imports): HybridEPDispatch.apply with the same arguments."""
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a.HybridEPDispatch.apply(
        x,
        routing_map,
        probs,
        group,
        num_local_experts,
        num_sms_dispatch_api,
        num_sms_combine_api,
        num_permuted_tokens,
        pad_multiple,
    )


def hybrid_ep_combine(x, handle, num_permuted_tokens, pad_multiple):
    """megatron-core 0.16.1's fused_a2a.hybrid_ep_combine: HybridEPCombine.apply."""
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a.HybridEPCombine.apply(x, handle, num_permuted_tokens, pad_multiple)


class _Float32ProbsNotice(logging.Filter):
    """Drops megatron's per-dispatch 'HybridEP (or DeepEP) only supports float32 probs' warning
    in probes (the plan's note says it once: capture_megatron.planner.margins.Margins.flex_note)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for that warning."""
        return not str(record.msg).startswith(FLOAT32_WARNINGS)


def install() -> None:
    """Give megatron-core's fused_a2a and token dispatcher HybridEP (idempotent)."""
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    log = logging.getLogger(token_dispatcher.__name__)
    if not any(isinstance(f, _Float32ProbsNotice) for f in log.filters):
        log.addFilter(_Float32ProbsNotice())
    why = "fake-cuda kernel set: DeepEP's HybridEP (flex dispatcher)"
    patches.patch(fused_a2a, "HybridEPBuffer", HybridEPBuffer, why, adds=True)
    patches.patch(fused_a2a, "HAVE_HYBRIDEP", True, why)
    for module in (fused_a2a, token_dispatcher):
        # names megatron-core binds only when DeepEP's hybrid kernels import: supplied here
        patches.patch(module, "hybrid_ep_dispatch", hybrid_ep_dispatch, why, adds=True)
        patches.patch(module, "hybrid_ep_combine", hybrid_ep_combine, why, adds=True)


def reset() -> None:
    """Forget the process-wide HybridEP buffer, so that the next probe makes its own."""
    from megatron.core.transformer.moe import fused_a2a

    fused_a2a.reset_hybrid_ep_buffer()
