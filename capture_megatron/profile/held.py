"""What a probe's chunk holds for good, read from the live objects: parameters, DDP's gradient
buffers and the optimizer's state (storages counted once), Megatron's global memory buffers
(with the GPU kernel set, TE's dummy wgrad buffers) and the MoE token dispatchers' routing state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_leaves

from capture_megatron.records import BufferBytes

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    from capture_megatron.config import Kernels


def _storages_bytes(tensors: Iterable[torch.Tensor], exclude: set[int]) -> int:
    seen, total = set(exclude), 0
    for t in tensors:
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes()
    return total


def static_bytes(
    model: DistributedDataParallel, optimizer: MegatronOptimizer
) -> tuple[int, int, int]:
    """(param bytes, grad-buffer bytes, optimizer bytes) by walking the live objects."""
    # megatron-core's DDP shadows Module.buffers() with its list of _ParamAndGradBuffers
    buffers = list(model.buffers) + list(getattr(model, "expert_parallel_buffers", []))  # type: ignore[call-overload]
    params = [p for p in model.parameters()]
    param_bytes = _storages_bytes(
        [b.param_data for b in buffers if b.param_data is not None] or params, set()
    )
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    model_ptrs = {t.untyped_storage()._cdata for t in params}
    model_ptrs |= {b.grad_data.untyped_storage()._cdata for b in buffers}
    opt_tensors = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if inner is None:  # a chunk without parameters
            continue
        opt_tensors += [
            t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)
        ]
        opt_tensors += [p for g in inner.param_groups for p in g["params"]]
    return param_bytes, grad_bytes, _storages_bytes(opt_tensors, model_ptrs)


def routing_state_bytes(model: torch.nn.Module, device_type: str) -> int:
    """Bytes the model's MoE token dispatchers hold on `device_type` between iterations: what each
    keeps from its layer's last forward (megatron's alltoall dispatcher: probs, routing_map,
    the permutation mapping, split and token counts), storages counted once. Host copies of
    counts (on a GPU run) are not device memory and are not counted."""
    dispatchers = [
        vars(m.token_dispatcher) for m in model.modules() if hasattr(m, "token_dispatcher")
    ]
    held = [
        t for t in tree_leaves(dispatchers) if torch.is_tensor(t) and t.device.type == device_type
    ]
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    return _storages_bytes(held, params)


def layer_buffer_bytes(model: torch.nn.Module, device_type: str) -> int:
    """Bytes of the registered module buffers of the model's transformer layers on `device_type`
    (megatron-core's YarnRotaryEmbedding registers cos/sin tables of
    original_max_position_embeddings rows in every MLA layer), storages counted once."""
    held = [
        b
        for name, b in model.named_buffers()
        if ".layers." in name and b.device.type == device_type
    ]
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    return _storages_bytes(held, params)


def buffers_held(gpu: bool) -> tuple[BufferBytes, ...]:
    """Megatron's global memory buffers and, for the GPU kernel set, TE's dummy wgrad buffers."""
    from megatron.core import parallel_state as ps

    held = [(name, dtype, t) for (name, dtype), t in ps.get_global_memory_buffer().buffer.items()]
    if gpu:
        from capture_megatron.emulate.gpu.linear import DUMMY_WGRADS

        held += [("te_dummy_wgrad", dtype, t) for (_, dtype), t in DUMMY_WGRADS.items()]
    found = [
        BufferBytes(name, str(dtype).replace("torch.", ""), t.numel() * t.element_size())
        for name, dtype, t in held
    ]
    return tuple(sorted(found, key=lambda b: (b.name, b.dtype, b.nbytes)))


def low_precision_state_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's linear layers keep for good for their low-precision compute (their
    weights' quantized copies and scaling state, which the GPU kernel set's Precision keeps under
    capture_megatron.emulate.gpu.common.HELD), storages counted once; 0 in the activation
    dtype."""
    from capture_megatron.emulate.gpu.common import HELD

    return _storages_bytes([t for m in model.modules() for t in getattr(m, HELD, ())], set())


def low_precision_param_mask(model: torch.nn.Module, kernels: Kernels | None) -> tuple[bool, ...]:
    """Per parameter (model.parameters() order), whether it is a low-precision parameter: with
    `kernels` (capture_megatron.config.Kernels, None for the CPU set) keeping the linear layers'
    weights as low-precision parameters (Kernels.low_precision_params), the weight of a layer
    that computes in that precision; empty otherwise."""
    from capture_megatron.emulate.gpu.common import HELD

    if kernels is None or not kernels.low_precision_params:
        return ()
    low = {id(w) for m in model.modules() if hasattr(m, HELD) for w in _weights(m)}
    return tuple(id(p) in low for p in model.parameters())


def _weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """A TE layer's own weights: `weight`, or a grouped linear's `weight0` ... `weight{n-1}`
    (one per expert; biases are never quantized)."""
    return [
        p
        for name, p in module.named_parameters(recurse=False)
        if name == "weight" or (name.startswith("weight") and name[6:].isdigit())
    ]


def clear_process_buffers() -> None:
    """Forget the fake-cuda kernel set's process-wide buffers (TE's dummy wgrads, userbuffers,
    HybridEP's and DeepEP's buffer objects), so that a probe holds those of its own shapes only."""
    from capture_megatron.emulate.gpu import deepep, flex
    from capture_megatron.emulate.gpu.linear import DUMMY_WGRADS, USERBUFFERS

    DUMMY_WGRADS.clear()
    USERBUFFERS.clear()
    flex.reset()
    deepep.reset()
