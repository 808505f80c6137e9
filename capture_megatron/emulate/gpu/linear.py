"""Transformer Engine's linear layers and weight-gradient fusion, on megatron's own linear code.

megatron's ColumnParallelLinear / RowParallelLinear keep what TE's Linear / LayerNormLinear keep
for backward — the local input (the sequence-parallel shard, re-gathered in backward) and the
weight — and allocate the same dgrad, reduce-scatter and wgrad tensors (TE 5671fd36
module/linear.py, layernorm_linear.py; docs/MEMORY_MODEL.md). Two things differ, both handled
here:
1. Sequence parallelism: megatron all-gathers a column-parallel layer's input into its persistent
   global buffer; TE gathers into a fresh tensor and frees it after the GEMM (forward,
   layernorm_linear.py:272-276, 378-380) and after the wgrad GEMM (backward). TELinearFunction
   runs megatron's autograd function with fresh gather buffers (linear_qkv, linear_fc1; the
   output layer stays megatron's, with its global buffer, as in a TE run).
2. --gradient-accumulation-fusion (Megatron-LM's default): the wgrad GEMM accumulates into the fp32
   main gradient in place (apex's fused_weight_gradient_mlp_cuda / TE's fused wgrad: no new
   tensor), and autograd gets TE's dummy wgrad: one persistent buffer per distinct weight shape
   (module/base.py:66, 81-94 get_dummy_wgrad), which megatron's own linear layers use too when TE
   is installed (megatron/core/tensor_parallel/layers.py:587-603).
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from capture_megatron.config import versions
from capture_megatron.emulate import patches
from capture_megatron.emulate.gpu.common import FULL, Precision, is_fake

DUMMY_WGRADS: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
"""TE's get_dummy_wgrad cache: one buffer per (shape, dtype), kept for the process's life."""


def dummy_wgrad(shape: list[int], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """TE's get_dummy_wgrad: the cached buffer of this shape and dtype (allocated once)."""
    key = (tuple(shape), dtype)
    if key not in DUMMY_WGRADS:
        DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype, device=torch.cuda.current_device())
    if zero:
        DUMMY_WGRADS[key].zero_()
    return DUMMY_WGRADS[key]


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
    """The fused wgrad GEMM: main_grad += grad_output^T total_input, in place."""
    if not is_fake(main_grad):
        g = grad_output.reshape(-1, grad_output.shape[-1])
        x = total_input.reshape(-1, total_input.shape[-1])
        main_grad.add_((g.t().to(main_grad.dtype)) @ x.to(main_grad.dtype))


def wgrad_extension() -> types.ModuleType:
    """apex's fused_weight_gradient_mlp_cuda as megatron calls it."""
    module = types.ModuleType("fused_weight_gradient_mlp_cuda", f"fake-cuda kernels ({__name__})")
    module.wgrad_gemm_accum_fp32 = _accumulate  # type: ignore[attr-defined]  # a stand-in module's kernels
    module.wgrad_gemm_accum_fp16 = _accumulate  # type: ignore[attr-defined]  # as above
    return module


class _FreshBuffers:
    """A global memory buffer that hands out a new tensor on every request (TE's gathers)."""

    def get_tensor(self, shape, dtype, name):
        """A new tensor of the shape and dtype."""
        del name
        return torch.empty(shape, dtype=dtype, device=torch.cuda.current_device())


USERBUFFERS: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
"""--tp-comm-overlap: TE's userbuffers the gathers fill, one per (shape, dtype), allocated once.
The real ones come from cuMemCreate / cudaMalloc, outside torch's caching allocator: probes never
report them (what a run needs for them is a margin: capture_megatron.config
.userbuffers.userbuffer_bytes_per_token)."""


class _UserBuffers:
    """A global memory buffer that gathers into the persistent userbuffers (TE with
    --tp-comm-overlap: `fill_userbuffers_buffer_for_all_gather`, layernorm_linear.py:262-268)."""

    def get_tensor(self, shape, dtype, name):
        """The userbuffer of the shape and dtype."""
        del name
        key = (tuple(shape), dtype)
        if key not in USERBUFFERS:
            USERBUFFERS[key] = torch.empty(shape, dtype=dtype, device=torch.cuda.current_device())
        return USERBUFFERS[key]


@contextlib.contextmanager
def _gather_buffers(userbuffers: bool = False):
    from megatron.core.tensor_parallel import layers

    saved = layers.get_global_memory_buffer
    layers.get_global_memory_buffer = _UserBuffers if userbuffers else _FreshBuffers
    try:
        yield
    finally:
        layers.get_global_memory_buffer = saved


@functools.cache
def _function(userbuffers: bool = False):
    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication as Megatron,
    )

    class TELinearFunction(Megatron):
        """megatron's linear autograd function with TE's transient sequence-parallel gathers
        (or, with userbuffers, gathers into TE's persistent userbuffers)."""

        @staticmethod
        def forward(ctx, *args):
            """megatron's forward, gathering into a fresh tensor (or a userbuffer)."""
            with _gather_buffers(userbuffers):
                return Megatron.forward(ctx, *args)

        @staticmethod
        def backward(ctx, *grads):
            """megatron's backward, re-gathering into a fresh tensor (or a userbuffer)."""
            with _gather_buffers(userbuffers):
                return Megatron.backward(ctx, *grads)

    return TELinearFunction


def te_linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
              sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=None,
              async_grad_allreduce=None, tp_group=None, userbuffers=False,
              gtp_remat_size=1):  # fmt: skip
    """megatron's linear_with_grad_accumulation_and_async_allreduce on TELinearFunction
    (megatron-core 0.19's gtp_remat_size: weights sharded over --tensor-parallel-num-weight-shards
    ranks, refused by flags.policy; 1 here)."""
    from megatron.core.tensor_parallel.layers import get_tensor_model_parallel_group_if_none

    del async_grad_allreduce
    if gtp_remat_size != 1:
        raise RuntimeError("the GPU kernel set does not emulate GTP-sharded weights")
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    # megatron-core 0.17+'s autograd function takes gtp_remat_size last
    extra = () if versions.current() == versions.V0_16 else (gtp_remat_size,)
    return _function(userbuffers).apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, wgrad_deferral_limit, tp_group, *extra,
    )  # fmt: skip


def te_column_linear(precision: Precision | None = None, userbuffers: bool = False):
    """megatron's ColumnParallelLinear with TE's gathers (linear_qkv and linear_fc1 of TE; with
    `userbuffers`, --tp-comm-overlap's), keeping what TE's layers keep in `precision` (None: the
    activation dtype)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    precise = precision or FULL

    class TEColumnParallelLinear(ColumnParallelLinear):
        """ColumnParallelLinear whose sequence-parallel gathers are transient, as in TE; TE's
        modules work on (and keep) a contiguous input (module/base.py prepare_forward: a copy of
        a strided view such as MLA's key/value latent split from its rotary key)."""

        def _forward_impl(self, input, weight, *args, **kwargs):
            precise.keep_weights(self, [weight])
            gathered = bool(kwargs.get("sequence_parallel"))
            input = input.contiguous()
            with precise.saving([input], gathered):
                # megatron-core passes fewer positional arguments than reach `userbuffers`
                return te_linear(input, weight, *args, **kwargs, userbuffers=userbuffers)  # type: ignore[misc]

    return TEColumnParallelLinear


def te_row_linear(precision: Precision | None = None):
    """megatron's RowParallelLinear (TE's linear_proj and linear_fc2 keep the same in bf16),
    keeping what TE's layers keep in `precision` (None: the activation dtype)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if precision is None:
        return RowParallelLinear
    precise = precision

    class TERowParallelLinear(RowParallelLinear):
        """RowParallelLinear keeping the precision's input copy and weight state."""

        def _forward_impl(self, input, weight, *args, **kwargs):
            precise.keep_weights(self, [weight])
            with precise.saving([input], False):
                return super()._forward_impl(input, weight, *args, **kwargs)

    return TERowParallelLinear


class DuplicatedLinear(torch.nn.Module):
    """TE's Linear with parallel_mode 'duplicated' (megatron's TELinear; MLA's down-projections
    in the TE spec): the whole [out, in] weight on every TP rank, no communication; it keeps its
    input and the weight, and its backward allocates the input gradient and the weight gradient
    (fused into main_grad with --gradient-accumulation-fusion) as megatron's linear function does
    without TP. Under sequence parallelism each rank sees its own tokens, so the weight is marked
    for the TP all-reduce of finalize_model_grads, as megatron's TELinear marks it."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool = False, parallel_mode: str | None = "duplicated",
                 **_unused):  # fmt: skip
        super().__init__()
        if bias or parallel_mode != "duplicated":
            raise ValueError("the duplicated linear of the GPU kernel set has no bias")
        self.config, self.skip_bias_add = config, skip_bias_add
        device = torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        )
        if config.perform_initialization:
            init_method(self.weight)
        self.weight.allreduce = True  # type: ignore[attr-defined]  # megatron-core's marker
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron-core's marker

    precision: Precision = FULL
    """How it computes (duplicated_linear sets it): a low-precision recipe's input copy and
    weight state."""

    def forward(self, x: torch.Tensor):
        """(x W^T, None)."""
        from megatron.core.tensor_parallel.layers import (
            linear_with_grad_accumulation_and_async_allreduce,
        )

        fused = self.config.gradient_accumulation_fusion
        x = x.contiguous()
        self.precision.keep_weights(self, [self.weight])
        with self.precision.saving([x], False):
            out = linear_with_grad_accumulation_and_async_allreduce(
                x, self.weight, None, fused, False, False
            )
        return out, None


class AnyDuplicatedLinear:
    """Equal to DuplicatedLinear and its low-precision classes (duplicated_linear): what MLA's
    spec check (`linear_q_down_proj in [TELinear]`) compares the down projections with."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type) and issubclass(other, DuplicatedLinear)

    __hash__ = object.__hash__


def duplicated_linear(precision: Precision | None = None) -> type:
    """DuplicatedLinear computing in `precision` (None: the activation dtype)."""
    if precision is None:
        return DuplicatedLinear
    return type("DuplicatedLinear", (DuplicatedLinear,), {"precision": precision})


def install() -> None:
    """Make megatron's fused wgrad path and TE's dummy wgrad available (idempotent)."""
    import sys

    from megatron.core.tensor_parallel import layers

    why = "fake-cuda kernel set: apex's fused wgrad (gradient_accumulation_fusion)"
    ext = sys.modules.get("fused_weight_gradient_mlp_cuda") or wgrad_extension()
    patches.patch(sys.modules, "fused_weight_gradient_mlp_cuda", ext, why, adds=True)
    patches.patch(layers, "fused_weight_gradient_mlp_cuda", ext, why, adds=True)
    patches.patch(layers, "_grad_accum_fusion_available", True, why)
    patches.patch(layers, "HAVE_TE", True, why)
    patches.patch(layers, "get_dummy_wgrad", dummy_wgrad, why, adds=True)
    from megatron.core.transformer import multi_latent_attention

    # its spec check: a duplicated linear; TE's low-precision input-saving switch does not apply
    why = "fake-cuda kernel set: TE's duplicated Linear where MLA looks for TELinear"
    patches.patch(multi_latent_attention, "TELinear", AnyDuplicatedLinear(), why)
    patches.patch(multi_latent_attention, "HAVE_TE", False, why)
