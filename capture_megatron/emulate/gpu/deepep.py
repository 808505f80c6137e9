"""DeepEP, the flex dispatcher's --moe-flex-dispatcher-backend deepep (megatron-core's default), on
the fake-cuda device.

megatron-core 0.16.1's fused_a2a.py builds `deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)`
(get_buffer, sized by Buffer.get_dispatch_config / get_combine_config's size hints) and calls its
get_dispatch_layout / dispatch / combine from FusedDispatch and FusedCombine; _DeepepManager
(token_dispatcher.py) turns the received top-k indices into a multi-hot routing map and permutes
the received tokens for the experts. This module is that Buffer, after deepseek-ai/DeepEP at
eb9cee7de5a24193bf09500668d3a619d3d3f3fb (the commit Megatron-LM core_v0.16.1 installs):
deep_ep/buffer.py and the tensors csrc/deep_ep.cpp returns through torch:

- get_dispatch_layout: tokens per rank int32 [ranks], per RDMA rank int32 [ranks / 8] (across
  nodes, else None), per expert int32 [experts], is_token_in_rank bool [tokens, ranks];
- dispatch without a handle (forward): the received tokens [received, hidden] in the input's
  dtype, their top-k indices int64 and weights float32 [received, top-k], the received count per
  local expert (a host list), and the handle: within a node rank_prefix_matrix int32 [ranks,
  ranks], channel_prefix_matrix and recv_channel_prefix_matrix int32 [ranks, channels],
  recv_src_idx int32 [received], is_token_in_rank and send_head int32 [tokens, ranks]; across
  nodes is_token_in_rank, rdma_channel_prefix_matrix int32 [nodes, channels],
  gbl_channel_prefix_matrix int32 [ranks, channels], recv_rdma_channel_prefix_matrix int32
  [nodes, channels], recv_rdma_rank_prefix_sum int32 [nodes], recv_gbl_channel_prefix_matrix
  int32 [ranks, channels], recv_gbl_rank_prefix_sum int32 [ranks], recv_src_meta uint8
  [received, 8], send_rdma_head int32 [tokens, nodes] and send_nvl_head int32 [received over
  RDMA, 8];
- dispatch with a handle (the backward of combine): the received tokens only;
- combine: the combined tokens [tokens, hidden] and, with weights (the backward of dispatch),
  float32 [tokens, top-k].
DeepEP's buffers and workspace are cudaMalloc / NVSHMEM memory, counted outside the allocator
(features.dispatch.deepep_buffer_bytes), never here.

How many tokens a rank receives depends on the routing values of every rank, which a fake job
does not have: megatron-core refuses DeepEP with padded expert inputs, so the routing forecast
(the factor a padded probe pads every expert to) rides on the config
(capture_megatron.megatron.moe.flex_forecast) and fixes the counts
(features.dispatch.deepep_received): dispatch returns tensors of those sizes, and where
_DeepepManager reads values (boolean indexing and repeat_interleave in _indices_to_multihot, the
.item() of the permuted rows, the experts' .tolist() of tokens per expert) the same sizes answer
(KnownCounts). Real tensors never reach this module.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import is_fake
from capture_megatron.features import dispatch as rules

FACTOR = "flex_routing_factor"
"""The TransformerConfig attribute that carries a probe's routing forecast to DeepEP's emulation
(set by capture_megatron.megatron.moe.flex_forecast; megatron-core never reads it)."""
_ACTIVE: list[rules.Received] = []


class EventHandle:
    """deep_ep.utils.EventHandle: a CUDA event (nothing to record on the fake device)."""


class EventOverlap:
    """deep_ep.utils.EventOverlap: work runs in program order here."""

    def __init__(self, event: object = None, extra_tensors: object = None) -> None:
        self.event = event
        """The wrapped event."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for."""


class Config:
    """deep_ep.Config with the size hints of csrc/config.hpp (features.dispatch.DeepepConfig)."""

    def __init__(self, spec: rules.DeepepConfig) -> None:
        self.spec = spec
        """The chunk sizes."""

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes."""
        return self.spec.nvl_bytes(hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes (0 within a node)."""
        return self.spec.rdma_bytes(hidden_bytes, num_ranks)


class Buffer:
    """deep_ep.Buffer (buffer.py at eb9cee7) in normal (not low-latency) mode, as megatron-core
    0.16.1 calls it."""

    num_sms: int = rules.DEEPEP_NUM_SMS
    """SMs of the normal kernels (Buffer.set_num_sms)."""

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, **_: object):
        self.group = group
        """The expert TP x EP process group."""
        self.group_size = group.size()
        """Ranks of the group."""
        self.num_nvl_bytes = num_nvl_bytes
        """NVLink buffer bytes (outside the allocator)."""
        self.num_rdma_bytes = num_rdma_bytes
        """RDMA buffer bytes (outside the allocator)."""
        if self.group_size not in rules.DEEPEP_GROUPS:
            raise ValueError(f"Unsupported number of EP ranks: {self.group_size}")

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Buffer.set_num_sms (megatron-core's moe_deepep_num_sms)."""
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Buffer.get_dispatch_config."""
        return Config(rules.DeepepConfig.of("dispatch", num_ranks, Buffer.num_sms))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Buffer.get_combine_config."""
        return Config(rules.DeepepConfig.of("combine", num_ranks, Buffer.num_sms))

    @property
    def _nodes(self) -> int:
        return max(self.group_size // rules.NVL_PEERS, 1)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, *_, **__):
        """(tokens per rank, per RDMA rank or None, per expert, is_token_in_rank, event)."""
        dev, ranks, tokens = topk_idx.device, self.group_size, topk_idx.shape[0]
        rdma = None
        if self._nodes > 1:
            rdma = torch.empty(self._nodes, dtype=torch.int32, device=dev)
        return (
            torch.empty(ranks, dtype=torch.int32, device=dev),
            rdma,
            torch.empty(num_experts, dtype=torch.int32, device=dev),
            torch.empty((tokens, ranks), dtype=torch.bool, device=dev),
            EventOverlap(),
        )

    def dispatch(self, x: torch.Tensor, handle: tuple | None = None, **kw):
        """(received tokens, top-k indices, top-k weights, per-expert counts, handle, event);
        with a handle only the received tokens."""
        if handle is not None:
            received = handle[3].shape[0] if self._nodes == 1 else handle[7].shape[0]
            out = torch.empty((received, x.shape[1]), dtype=x.dtype, device=x.device)
            return out, None, None, None, None, EventOverlap()
        if not _ACTIVE:
            raise RuntimeError("DeepEP's emulation dispatches only at a routing forecast")
        counts, dev = _ACTIVE[-1], x.device
        topk_idx, weights = kw["topk_idx"], kw["topk_weights"]
        n, k = counts.tokens, topk_idx.shape[1]
        out = torch.empty((n, x.shape[1]), dtype=x.dtype, device=dev)
        idx = torch.empty((n, k), dtype=topk_idx.dtype, device=dev)
        w = torch.empty((n, k), dtype=weights.dtype, device=dev)
        handle = self._handle(x.shape[0], counts, kw["is_token_in_rank"], dev)
        return out, idx, w, list(counts.per_expert), handle, EventOverlap()

    def _handle(self, tokens: int, counts: rules.Received, in_rank, dev) -> tuple:
        """The communication handle intranode_dispatch / internode_dispatch return."""
        ranks, ch, nodes = self.group_size, self.get_dispatch_config(self.group_size), self._nodes
        channels = ch.spec.channels

        def i32(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.int32, device=dev)

        if nodes == 1:
            return (
                i32(ranks, ranks),
                i32(ranks, channels),
                i32(ranks, channels),
                i32(counts.tokens),
                in_rank,
                i32(tokens, ranks),
            )
        meta = torch.empty((counts.tokens, rules.SOURCE_META_BYTES), dtype=torch.uint8, device=dev)
        return (
            in_rank,
            i32(nodes, channels),
            i32(ranks, channels),
            i32(nodes, channels),
            i32(nodes),
            i32(ranks, channels),
            i32(ranks),
            meta,
            i32(tokens, nodes),
            i32(counts.node_tokens, rules.NVL_PEERS),
        )

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights=None, **_: object):
        """(combined tokens [tokens, hidden], combined weights or None, event)."""
        tokens = handle[5].shape[0] if self._nodes == 1 else handle[0].shape[0]
        out = torch.empty((tokens, x.shape[1]), dtype=x.dtype, device=x.device)
        w = None
        if topk_weights is not None:
            shape = (tokens, topk_weights.shape[1])
            w = torch.empty(shape, dtype=topk_weights.dtype, device=x.device)
        return out, w, EventOverlap()


class KnownCounts(TorchDispatchMode):
    """Answers the ops whose output size is a routing value with the forecast's: boolean
    indexing, masked_select, repeat_interleave by counts (`routed` elements) and .item() (the
    permuted rows, `routed`); every other op passes through."""

    def __init__(self, routed: int):
        super().__init__()
        self.routed = routed
        """(token, local expert) pairs this rank receives."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            return self.routed
        if func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):
            src = args[0]
            return torch.empty(self.routed, dtype=src.dtype, device=src.device)
        if func is aten.masked_select.default:
            return torch.empty(self.routed, dtype=args[0].dtype, device=args[0].device)
        if func is aten.repeat_interleave.Tensor:
            return torch.empty(self.routed, dtype=torch.int64, device=args[0].device)
        return func(*args, **(kwargs or {}))


def received(manager, tokens: int) -> rules.Received:
    """What a _DeepepManager's rank receives for `tokens` sent by each rank, at its config's
    routing forecast (capacity factor, else the probe's factor)."""
    config = manager.config
    factor = config.moe_expert_capacity_factor or getattr(config, FACTOR, None)
    if not factor:
        raise RuntimeError(
            "DeepEP's emulation needs a routing forecast on the config (capture_megatron"
            ".megatron.moe.flex_forecast)"
        )
    local = manager.num_local_experts
    experts, topk = config.num_moe_experts, config.moe_router_topk
    return rules.deepep_received(tokens, manager.group.size(), experts, topk, local, factor)


def _patch_manager() -> None:
    from megatron.core.transformer.moe.token_dispatcher import _DeepepManager

    if not patches.first("deepep_manager"):
        return

    dispatch = _DeepepManager.dispatch
    permuted = _DeepepManager.get_permuted_hidden_states_by_experts

    def dispatch_(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if not is_fake(hidden_states):
            return dispatch(self, hidden_states, async_finish, allocate_on_comm_stream)
        counts = received(self, hidden_states.shape[0])
        _ACTIVE.append(counts)
        try:
            out = dispatch(self, hidden_states, async_finish, allocate_on_comm_stream)
        finally:
            _ACTIVE.pop()
        with _disable_current_modes():  # the host list megatron made a tensor of, as a real one
            self.tokens_per_expert = torch.tensor(counts.per_expert, dtype=torch.int64)
        self.routed = counts.routed
        return out

    def permuted_(self, hidden_states):
        if not is_fake(hidden_states):
            return permuted(self, hidden_states)
        with KnownCounts(self.routed):
            return permuted(self, hidden_states)

    why = "fake-cuda kernel set: DeepEP's received token counts at the routing forecast"
    patches.patch(_DeepepManager, "dispatch", dispatch_, why)
    patches.patch(_DeepepManager, "get_permuted_hidden_states_by_experts", permuted_, why)


def fused_dispatch(
    x, token_indices, token_probs, num_experts, group, async_finish=False,
    allocate_on_comm_stream=False,
):  # fmt: skip
    """megatron-core 0.16.1's fused_a2a.fused_dispatch (defined there only when deep_ep
    imports): FusedDispatch.apply with the same arguments."""
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a.FusedDispatch.apply(
        x.contiguous(), token_indices, token_probs, num_experts, group, async_finish,
        allocate_on_comm_stream,
    )  # fmt: skip


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    """megatron-core 0.16.1's fused_a2a.fused_combine: FusedCombine.apply."""
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a.FusedCombine.apply(x, group, handle, async_finish, allocate_on_comm_stream)


def set_deepep_num_sms(num_sms: int) -> None:
    """megatron-core 0.16.1's fused_a2a.set_deepep_num_sms."""
    Buffer.set_num_sms(num_sms)


def install() -> None:
    """Give megatron-core's fused_a2a and token dispatcher DeepEP (idempotent)."""
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    why = "fake-cuda kernel set: DeepEP's Buffer (flex dispatcher)"
    classes: dict[str, object] = {
        "Buffer": Buffer,
        "EventHandle": EventHandle,
        "EventOverlap": EventOverlap,
    }
    for name, value in classes.items():
        patches.patch(fused_a2a, name, value, why, adds=True)
    patches.patch(fused_a2a, "HAVE_DEEP_EP", True, why)
    functions: dict[str, object] = {
        "fused_dispatch": fused_dispatch,
        "fused_combine": fused_combine,
        "set_deepep_num_sms": set_deepep_num_sms,
    }
    for module in (fused_a2a, token_dispatcher):
        for name, value in functions.items():
            patches.patch(module, name, value, why, adds=True)
    _patch_manager()


def reset() -> None:
    """Forget the process-wide DeepEP buffer and SM count, so that the next probe makes its own."""
    from megatron.core.transformer.moe import fused_a2a

    fused_a2a._buffer = None
    Buffer.num_sms = rules.DEEPEP_NUM_SMS
