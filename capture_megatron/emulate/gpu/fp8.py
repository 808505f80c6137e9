"""Transformer Engine's FP8 linear layers (--fp8-format) on the fake-cuda device.

What TE 5671fd36 keeps under FP8 beyond what its bf16 path keeps (capture_megatron.features.fp8 has
the byte counts and their sources; docs/MEMORY_MODEL.md the tables):
1. Each linear layer keeps its input for the wgrad GEMM quantized instead of in bf16
   (`module/linear.py:411-425`, `layernorm_linear.py:416-427`): the column-wise copy, or the
   row-wise local shard when a per-tensor-scaled input is all-gathered in backward. The bf16
   input dies unless another module keeps it (linear_proj's input is the attention output, which
   the attention core keeps: FP8 adds the copy there). `saved_in_fp8` swaps the input megatron's
   linear function saves for such a copy (autograd's saved-tensor hooks) and dequantizes it in
   backward, where TE quantizes the output gradient instead: a transient of the same order.
2. Each layer keeps an FP8 copy of its weight for the module's life (the workspace cached under
   'weight', row-wise and column-wise), or with --fp8-param-gather the weight's column-wise copy
   and scales (`module/base.py:1346-1456`), and its recipe's scaling state (amax history and
   scales with delayed scaling, `module/base.py:707-742`). `keep_weight_state` allocates them at
   the layer's first forward, as TE does, under the module's `common.HELD` list, where the probe
   reads them (capture_megatron.profile.held.low_precision_state_bytes).
`Fp8Setting` is the GPU kernel set's Precision (capture_megatron.emulate.gpu.common) for FP8:
megatron/gpu_spec.py builds the layer specs' linear layers with `setting(kernels)`.
On real tensors the copies hold real FP8 values (scaled to e4m3's range) and backward computes
with them; on fake tensors they only allocate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from capture_megatron.emulate.gpu.common import E4M3_MAX, HELD, Precision, is_fake
from capture_megatron.features.fp8 import saved_input_bytes, scaling_state_bytes, weight_cache_bytes

if TYPE_CHECKING:
    from capture_megatron.config import Kernels


@dataclass(frozen=True)
class Fp8Setting(Precision):
    """The FP8 recipe a layer runs (from capture_megatron.config.Kernels): the Precision whose
    layers keep TE's FP8 copies (module docstring)."""

    recipe: str
    """delayed, tensorwise, mxfp8 or blockwise."""
    param_gather: bool
    """--fp8-param-gather: the weights are FP8 parameters."""
    amax_history_len: int
    """--fp8-amax-history-len (delayed scaling)."""

    def keep_weights(self, module: torch.nn.Module, weights: list[torch.Tensor]) -> None:
        """keep_weight_state under this recipe."""
        keep_weight_state(module, weights, self)

    @contextlib.contextmanager
    def saving(self, inputs: list[torch.Tensor], gathered: bool) -> Iterator[None]:
        """saved_in_fp8 under this recipe."""
        with saved_in_fp8(inputs, self, gathered):
            yield


def setting(kernels: Kernels | None) -> Fp8Setting | None:
    """The FP8 recipe TE's linear layers run under `kernels` (None without --fp8-format, or for
    the CPU kernel set)."""
    if kernels is None or not kernels.fp8:
        return None
    return Fp8Setting(kernels.fp8_recipe, kernels.fp8_param_gather, kernels.fp8_amax_history_len)


class Fp8Saved:
    """A tensor saved for backward as TE keeps it under FP8: FP8 data plus its scales."""

    def __init__(self, t: torch.Tensor, setting: Fp8Setting, gathered: bool):
        rows, cols = t.numel() // t.shape[-1], t.shape[-1]
        extra = saved_input_bytes(setting.recipe, rows, cols, gathered) - rows * cols
        self.shape, self.dtype, self.scale = t.shape, t.dtype, 1.0
        if is_fake(t):
            self.data = _fp8_copy(t)
        else:
            amax = float(t.detach().abs().max()) if t.numel() else 0.0
            self.scale = E4M3_MAX / amax if amax > 0 else 1.0
            self.data = (t.detach() * self.scale).to(torch.float8_e4m3fn)
        self.scales = torch.empty(extra, dtype=torch.uint8, device=t.device)

    def dequantize(self) -> torch.Tensor:
        """The saved values in the activation dtype (a new tensor)."""
        return (self.data.to(self.dtype) / self.scale).view(self.shape)


def _fp8_copy(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte copy of `t` (on fake tensors: the allocation only)."""
    return torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device)


@contextlib.contextmanager
def saved_in_fp8(inputs: list[torch.Tensor], setting: Fp8Setting | None, gathered: bool):
    """Inside, autograd saves any tensor sharing a storage with `inputs` (not a parameter) as an
    Fp8Saved copy (`gathered`: the layer all-gathers it in backward); nothing without FP8. An
    input not gathered also has its row-wise FP8 copy, which the forward GEMM reads, alive
    inside (TE quantizes both usages, then drops the row-wise one: `linear.py:411-425`)."""
    if setting is None:
        yield
        return
    rowwise = [] if gathered else [_fp8_copy(t) for t in inputs]
    storages = {t.untyped_storage()._cdata for t in inputs}

    def pack(t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage()._cdata not in storages:
            return t
        return Fp8Saved(t, setting, gathered)

    def unpack(x):
        return x.dequantize() if isinstance(x, Fp8Saved) else x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
    del rowwise


def state_bytes(setting: Fp8Setting, weights: list[tuple[int, int]]) -> tuple[int, int]:
    """(weight copies, scaling state) bytes one TE module keeps for its [out, in] weights."""
    copies = sum(weight_cache_bytes(setting.recipe, o, i, setting.param_gather) for o, i in weights)
    return copies, scaling_state_bytes(setting.recipe, len(weights), setting.amax_history_len)


def keep_weight_state(module: torch.nn.Module, weights: list[torch.Tensor], setting) -> None:
    """Allocate, once per module, what TE keeps for its weights under FP8 (module docstring)."""
    if setting is None or hasattr(module, HELD):
        return
    shapes = [(w.shape[0], w.shape[1]) for w in weights]
    copies, scaling = state_bytes(setting, shapes)
    device = weights[0].device
    kept = [torch.empty(copies, dtype=torch.uint8, device=device)]
    if scaling:
        kept.append(torch.empty(scaling // 4, dtype=torch.float32, device=device))
    setattr(module, HELD, kept)  # a plain list: no buffer, never in a state dict
