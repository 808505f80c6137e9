"""Transformer Engine's GroupedLinear (the experts of --moe-grouped-gemm) on the fake-cuda device.

megatron-core's TEGroupedMLP runs each rank's local experts as two TE GroupedLinear layers
(TEColumnParallelGroupedLinear, TERowParallelGroupedLinear in megatron/core/extensions/
transformer_engine.py), one weight per expert (``weight0`` ... ``weight{n-1}``). What TE 2.8's
_GroupedLinear (transformer_engine/pytorch/module/grouped_linear.py) allocates and keeps computing
in bf16 / fp16, which GroupedLinearFunction below reproduces (a low-precision recipe adds what
its Precision keeps, capture_megatron.emulate.gpu.common):

- forward: the input split into per-expert views (torch.split, no copy), one output of
  [tokens, out_features]; kept for backward: the input views and the weights;
- backward: grad_output made contiguous and split into views, one dgrad of [tokens, in_features];
  with --gradient-accumulation-fusion the weight gradients accumulate into each weight's
  ``main_grad`` in place and autograd gets None (megatron's DDP sets no
  ``grad_added_to_main_grad``), otherwise one fresh weight gradient per expert, all allocated
  before they are returned;
- TE's multi-stream cuBLAS workspaces (4 x 32 MiB + 1 KiB on sm90, allocated once per process)
  are not allocated here: they are the probe's fixed workspace bytes
  (capture_megatron.profile.probe, GROUPED_GEMM_WORKSPACE).

As megatron's TEGroupedLinear does, the output (column) or input (row) width is divided by the
expert tensor-parallel size and the dispatcher does all communication; parameters are marked
``allreduce`` False under expert parallelism. Linear biases are not emulated (every grouped-GEMM
functional test disables them; capture_megatron.profile.experts refuses them). On real tensors the
function computes the real result (tests check it); on fake tensors it only allocates.
"""

from __future__ import annotations

import torch

from capture_megatron.emulate.gpu.common import FULL, Precision, is_fake

STREAMS = 4
"""TE's compute streams (transformer_engine/common/util/multi_stream.cpp), one workspace each."""


class GroupedLinearFunction(torch.autograd.Function):
    """TE 2.8's _GroupedLinear in bf16 / fp16, without biases: per-expert GEMMs over split
    views."""

    @staticmethod
    def forward(ctx, inp, m_splits, fuse_wgrad, *weights):
        """One [tokens, out] output; the input views and weights kept for backward."""
        view = inp.reshape(-1, weights[0].shape[1])
        mats = torch.split(view, m_splits)
        out = torch.empty([sum(m_splits), weights[0].shape[0]], dtype=inp.dtype, device=inp.device)
        if not is_fake(inp):
            torch.cat([m @ w.t() for m, w in zip(mats, weights)], out=out)
        ctx.save_for_backward(*mats)  # the weights are parameters: kept on ctx
        ctx.m_splits, ctx.fuse_wgrad, ctx.inp_shape = m_splits, fuse_wgrad, inp.shape
        ctx.weights = weights
        return out.view(-1, *inp.shape[1:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        """dgrad into one new tensor; wgrads fused into main_grad, or one new tensor each."""
        mats = ctx.saved_tensors
        grads = torch.split(grad_output.contiguous().view(-1, grad_output.shape[-1]), ctx.m_splits)
        dgrad = torch.empty(
            (sum(ctx.m_splits), ctx.weights[0].shape[1]), dtype=grad_output.dtype,
            device=grad_output.device,
        )  # fmt: skip
        real = not is_fake(grad_output)
        if real:
            torch.cat([g @ w for g, w in zip(grads, ctx.weights)], out=dgrad)
        if ctx.fuse_wgrad:
            for g, m, w in zip(grads, mats, ctx.weights):
                if real:
                    w.main_grad.add_((g.t() @ m).to(w.main_grad.dtype))
        wgrads = [_wgrad(w, ctx.fuse_wgrad) for w in ctx.weights]
        if real and not ctx.fuse_wgrad:
            for out, g, m in zip(wgrads, grads, mats):
                torch.mm(g.t(), m, out=out)
        return (dgrad.view(ctx.inp_shape), None, None, *wgrads)


def _wgrad(weight, fused: bool):
    """What TE hands autograd as one weight's gradient: a fresh tensor of the weight's shape
    (with fusion: of its main_grad's shape and the weight's dtype, after marking the gradient
    accumulated, TE's handle_custom_ddp_from_mcore; megatron's DDP's hook then drops it)."""
    if fused and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.empty(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    if fused:
        return None
    return torch.empty(weight.size(), dtype=weight.dtype, device=weight.device)


class GroupedLinear(torch.nn.Module):
    """megatron's TEGroupedLinear on GroupedLinearFunction: `num_gemms` expert weights."""

    parallel_mode = ""
    """column or row (set by the two subclasses)."""
    precision: Precision = FULL
    """How the experts compute (set by grouped_classes): under a low-precision recipe each
    expert's input split is saved as TE's quantized copy and each weight keeps its quantized
    workspace."""

    def __init__(
        self, num_gemms: int, input_size: int, output_size: int, *, config, init_method,
        bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name=None,
        pg_collection=None, name=None,
    ):  # fmt: skip
        from megatron.core.process_groups_config import ProcessGroupCollection

        super().__init__()
        del skip_bias_add, tp_comm_buffer_name, name  # name: megatron-core 0.19's module names
        if bias:
            raise RuntimeError("the GPU kernel set's grouped GEMM emulates experts without biases")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        tp = pg_collection.expt_tp.size()
        if self.parallel_mode == "column":
            output_size //= tp
        else:
            input_size //= tp
        self.num_gemms, self.config = num_gemms, config
        expert_parallel = config.expert_model_parallel_size > 1
        for i in range(num_gemms):
            weight = torch.nn.Parameter(
                torch.empty(output_size, input_size, dtype=config.params_dtype,
                            device=torch.cuda.current_device())
            )  # fmt: skip
            init_method(weight)
            weight.allreduce = not (is_expert and expert_parallel)  # type: ignore[attr-defined]  # megatron-core's marker
            self.register_parameter(f"weight{i}", weight)

    def forward(self, x, m_splits):
        """(output, None), as megatron's TEGroupedLinear returns it without biases."""
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        fuse = self.config.gradient_accumulation_fusion
        self.precision.keep_weights(self, weights)
        with self.precision.saving([x], False):
            return GroupedLinearFunction.apply(x, list(m_splits), fuse, *weights), None


class ColumnGroupedLinear(GroupedLinear):
    """TEColumnParallelGroupedLinear: the output width split over expert TP."""

    parallel_mode = "column"


class RowGroupedLinear(GroupedLinear):
    """TERowParallelGroupedLinear: the input width split over expert TP."""

    parallel_mode = "row"


def grouped_classes(precision: Precision | None = None) -> tuple[type, type]:
    """(column, row) GroupedLinear classes computing in `precision` (None: the activation
    dtype)."""
    if precision is None:
        return ColumnGroupedLinear, RowGroupedLinear
    column = type("ColumnGroupedLinear", (ColumnGroupedLinear,), {"precision": precision})
    return column, type("RowGroupedLinear", (RowGroupedLinear,), {"precision": precision})


def workspace_bytes() -> int:
    """TE's multi-stream cuBLAS workspaces a grouped GEMM allocates once (sm90 sizes)."""
    from capture_megatron.config.kernels import TE_WORKSPACE

    return STREAMS * TE_WORKSPACE
