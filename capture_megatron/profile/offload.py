"""What megatron-core 0.16.1's fine-grained activation offloading would move off the device from
one transformer layer: measured on a probe's own chunk, through megatron-core's own call sites.

megatron-core opens a group around each offloadable module (`with off_interface(flag, tensor,
name)` in transformer_layer.py, attention.py, multi_latent_attention.py, moe/experts.py): a
saved-tensors hook collects what autograd saves inside it, and the group's `group_commit` copies
those of at least --min-offloaded-tensor-size elements that are not parameters to pinned host
memory and frees them on the device, with the tensors it names (`forced_released_tensors`, freed
by `untyped_storage().resize_(0)`). Its manager needs CUDA streams and refuses fake tensors
(`tensor_push` asserts), so here the same call sites run with every group switched on and a
recorder in the manager's place for one extra forward: per storage, the group that saved it
first, its largest saved tensor's elements and its bytes at the end of the forward (0 when a
selective-recompute checkpoint discarded it: nothing left to move). Storages also saved outside
every group stay referenced after an offload and are left out, unless a group frees them by hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from capture_megatron.features.activation_offload import OffloadTensor
from capture_megatron.megatron import versioned

FLAGS = {
    "offload_attn_norm": "attn_norm",
    "offload_qkv_linear": "qkv_linear",
    "offload_core_attention": "core_attn",
    "offload_attn_proj": "attn_proj",
    "offload_mlp_norm": "mlp_norm",
    "offload_expert_fc1": "expert_fc1",
    "offload_moe_act": "moe_act",
}
"""megatron-core's per-module switches (set from TransformerConfig at build) and their groups."""


class _Recorder:
    """Storages saved inside each group, and outside every group, during one forward."""

    def __init__(self) -> None:
        self.group: str | None = None
        self.first: dict[int, str] = {}
        self.numel: dict[int, int] = {}
        self.outside: set[int] = set()
        self.forced: set[int] = set()
        self.keep: dict[int, torch.Tensor] = {}  # a reference each, so that keys stay unique

    def pack(self, tensor: Any) -> Any:
        """The saved-tensors pack hook: note the storage, keep the tensor as autograd would."""
        plain = isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter)
        if plain and getattr(tensor, "offloading_activation", True):
            self.note(tensor, self.group)
        return tensor

    def note(self, tensor: torch.Tensor, group: str | None) -> int:
        """Record one saved tensor's storage under `group` (None: outside every group)."""
        key = tensor.untyped_storage()._cdata
        self.keep.setdefault(key, tensor)
        if group is None:
            self.outside.add(key)
        else:
            self.first.setdefault(key, group)
            self.numel[key] = max(self.numel.get(key, 0), tensor.numel())
        return key

    def rows(self) -> tuple[OffloadTensor, ...]:
        """Per storage a group saved (or frees by hand) and nothing outside the groups keeps."""
        out = []
        for key, group in self.first.items():
            if key in self.outside and key not in self.forced:
                continue
            nbytes = self.keep[key].untyped_storage().nbytes()
            if nbytes:
                out.append(OffloadTensor(group, self.numel[key], nbytes))
        return tuple(out)


@contextlib.contextmanager
def _recording(recorder: _Recorder) -> Iterator[None]:
    """megatron-core's offloading interface with `recorder` in its manager's place."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as Interface,
    )

    def enter(self: Any) -> Any:
        if self.offload:
            recorder.group = self.name
        return self.tensor

    def leave(self: Any, *args: Any) -> None:
        if self.offload:
            recorder.group = None

    def commit(tensor: Any, name: str, forced_released_tensors: Any = None, **_: Any) -> Any:
        for t in forced_released_tensors or ():
            if isinstance(t, torch.Tensor):
                recorder.forced.add(recorder.note(t, name))
        return tensor

    def offload(self: Any, tensor: Any, forced_released_tensors: Any = None, **_: Any) -> Any:
        return commit(tensor, self.name, forced_released_tensors) if self.offload else tensor

    # the group's end: 0.16's static group_commit(tensor, name, ...), 0.17's method group_offload
    name = versioned.offload_group_end()
    saved = {k: Interface.__dict__[k] for k in ("__enter__", "__exit__", name)}
    Interface.__enter__, Interface.__exit__ = enter, leave  # type: ignore[method-assign]  # patched, restored after
    setattr(Interface, name, staticmethod(commit) if name == "group_commit" else offload)
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            yield
    finally:
        for k, v in saved.items():
            setattr(Interface, k, v)


@contextlib.contextmanager
def _switched_on(model: Any) -> Iterator[None]:
    """Every offloading switch of the model's modules on, as --offload-modules with every group
    sets them (attn_norm / mlp_norm only where the norm is a module of its own)."""
    from megatron.core.transformer.identity_op import IdentityOp

    norm = {"offload_attn_norm": "input_layernorm", "offload_mlp_norm": "pre_mlp_layernorm"}
    before = []
    for module in model.modules():
        for attr in FLAGS:
            if hasattr(module, attr):
                own = attr not in norm or not isinstance(getattr(module, norm[attr]), IdentityOp)
                before.append((module, attr, getattr(module, attr)))
                setattr(module, attr, own)
    try:
        yield
    finally:
        for module, attr, value in before:
            setattr(module, attr, value)


def offload_tensors(model: Any, forward: Any) -> tuple[OffloadTensor, ...]:
    """Run `forward()` (one micro-batch's forward of the probe chunk `model`, returning its
    output) with every offloading group on and recorded; the storages megatron-core would
    offload. The output and its graph are dropped afterwards."""
    recorder = _Recorder()
    with _switched_on(model), _recording(recorder):
        output = forward()
    rows = recorder.rows()
    del output
    recorder.keep.clear()
    return rows
