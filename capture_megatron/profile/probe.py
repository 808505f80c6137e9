"""Run one probe: a real Megatron-Core chunk through megatron's own forward_step, backward_step,
finalize_model_grads and optimizer step, measured by a MemoryMeter.

The process plays TP rank 0 (and DP rank 0) of a `tp x dp` group. On cpu/fake devices the group is
torch's fake process group: collectives do not move data but every buffer megatron allocates for
them is allocated, so the memory is that of a real rank. The probe runs two iterations and measures
the second (the first allocates optimizer state and Megatron's global buffers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from capture_megatron.config.training import BuildOptions, OptimOptions, RunOptions
from capture_megatron.forecast.static import chunk_static
from capture_megatron.megatron.attention import rotary_tables_built_in_fp32
from capture_megatron.megatron.backend import Backend
from capture_megatron.megatron.builder import build_gpt, transformer_config
from capture_megatron.megatron.training import (
    make_optimizer,
    set_schedule_hooks,
    wrap_model,
)
from capture_megatron.profile import held
from capture_megatron.profile.experts import (
    expert_mask,
    grouped_workspace,
    reset_aux_loss_tracker,
)
from capture_megatron.profile.iteration import (
    ProbeChunk,
    drop_checkpoints,
    forward,
    hidden_input,
    iteration,
)
from capture_megatron.profile.offload import offload_tensors
from capture_megatron.profile.probed import model_shape, parallel_plan
from capture_megatron.profile.setup import Setup
from capture_megatron.records import Probe, ProfileRecord

if TYPE_CHECKING:
    from capture_megatron.memory.meter import MemoryMeter


@contextlib.contextmanager
def _no_dtype_casts(active: bool) -> Iterator[None]:
    """Float16Module casts its module with Module.bfloat16()/half(), which cannot swap fake
    parameters; the builder already creates every parameter in the training dtype, so the cast is
    skipped."""
    if not active:
        yield
        return
    saved = torch.nn.Module.bfloat16, torch.nn.Module.half
    # a patch of torch's class for the block's duration (restored below)
    torch.nn.Module.bfloat16 = torch.nn.Module.half = lambda self: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.bfloat16, torch.nn.Module.half = saved  # type: ignore[method-assign]  # restored


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Fake mode skips Float16Module's cast (see _no_dtype_casts), so parameters megatron creates
    without params_dtype (LanguageModelEmbedding's learned position table: torch.nn.Embedding) must
    be born in it."""
    if dtype is None:
        yield
        return
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


PROBE_LOSS_SCALE = 1.0
"""fp16 probes' initial loss scale (what the step allocates does not depend on it, as long as the
step is not skipped)."""


def build(probe: Probe, setup: Setup) -> ProbeChunk:
    """Build, wrap (Float16Module, DDP) and give an optimizer to the probe's chunk."""
    shape, plan, fake = model_shape(probe), parallel_plan(probe), setup.fake
    if probe.kind in ("first", "middle"):  # MTP sits on the last stage; megatron-core would put
        shape = shape.replace(mtp_num_layers=0)  # the final norm with a probe's last layer
        plan = plan.replace(mtp_layers=0)
    reset_aux_loss_tracker()
    backend = Backend.of(setup.device, setup.kernels)
    config = transformer_config(shape, plan, 0, BuildOptions(), backend)
    first, last = probe.kind in ("first", "only"), probe.kind in ("last", "only")
    with _default_dtype(config.params_dtype if fake else None):
        gpt = build_gpt(shape, plan, config, backend, probe.layers, first, last, None)
    if fake:  # built in the parameters' dtype here (_default_dtype), in fp32 by a real run
        rotary_tables_built_in_fp32(gpt)
    run = RunOptions(train_iters=2)
    with _no_dtype_casts(fake):
        model = wrap_model([gpt], shape, plan, run, check_for_nan_in_grad=not fake)
    # fp16: a loss scale the probe's gradients do not overflow, so that the measured step updates
    # (at Megatron-LM's 2^32 every probe step was skipped: no Adam temporaries were measured)
    optim = OptimOptions(initial_loss_scale=PROBE_LOSS_SCALE)
    optimizer, _ = make_optimizer(
        model, shape, plan, optim, run.train_iters, use_gloo_process_groups=False
    )
    config = set_schedule_hooks(model, optimizer, run)
    device = setup.tensor_device
    return ProbeChunk(model[0], optimizer, config, shape, plan, first, last, device, setup.kernels)


def measure(
    probe: Probe, meter: MemoryMeter, setup: Setup, timelines: bool = False
) -> ProfileRecord:
    """Build and run the probe (two iterations) and return what the second one measured (with the
    windows' allocation timelines when `timelines`, not on cuda)."""
    fake = setup.fake
    if setup.device == "fake-cuda":  # TE's dummy wgrads and userbuffers of this probe's shapes
        held.clear_process_buffers()
    chunk = build(probe, setup)
    iteration(chunk, meter, fake)
    got, lines = iteration(chunk, meter, fake, timelines, last=True)
    param_bytes, grad_bytes, optimizer_bytes = held.static_bytes(chunk.model, chunk.optimizer)
    numels = tuple(p.numel() for p in chunk.model.parameters())
    if fake:
        dp = probe.dp * probe.variant.cp
        optimizer_bytes = chunk_static(
            list(numels), probe.variant.dtype, dp, probe.distributed_optimizer
        ).optimizer
    record = ProfileRecord(
        device=setup.device,
        kernels=setup.kernel_set,
        versions=setup.versions,
        variant=probe.variant,
        shape=probe.shape,
        kind=probe.kind,
        layers=probe.layers,
        recompute_layers=probe.recompute_layers,
        dp=probe.dp,
        distributed_optimizer=probe.distributed_optimizer,
        param_numels=numels,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        input_bytes=got.input_bytes,
        output_bytes=got.output_bytes,
        saved_bytes=got.saved_bytes,
        forward_peak=got.forward_peak,
        backward_peak=got.backward_peak,
        residual_bytes=got.residual_bytes,
        step_peak=got.step_peak,
        buffers=held.buffers_held(setup.device == "fake-cuda"),
        workspace_bytes=_workspaces(probe, setup),
        timelines=lines,
        param_expert=expert_mask(chunk.model),
        retained_bytes=got.retained_bytes,
        retained_grad_bytes=got.retained_grad_bytes,
        routing_state_bytes=held.routing_state_bytes(chunk.model, torch.device(chunk.device).type),
        layer_buffer_bytes=held.layer_buffer_bytes(chunk.model, torch.device(chunk.device).type),
        low_precision_state_bytes=held.low_precision_state_bytes(chunk.model),
        param_low_precision=held.low_precision_param_mask(chunk.model, setup.kernels),
    )
    if probe.kind == "middle" and probe.layers == 1 and not probe.recompute_layers:
        record = dataclasses.replace(record, offload_tensors=_offloaded(chunk))
    del chunk
    gc.collect()
    return record


def _offloaded(chunk: ProbeChunk) -> tuple:
    """What fine-grained activation offloading would move off the device from the chunk's layer
    (capture_megatron.profile.offload), by one more forward; what it leaves is dropped."""
    from megatron.core.utils import get_attr_wrapped_model

    hidden = hidden_input(chunk.shape, chunk.plan, chunk.device).requires_grad_()
    rows = offload_tensors(chunk.model, lambda: forward(chunk, hidden))
    get_attr_wrapped_model(chunk.model, "set_input_tensor")(None)
    drop_checkpoints(chunk.model)
    return rows


def _workspaces(probe: Probe, setup: Setup) -> int:
    """GEMM workspaces the process keeps that no probe allocates: the kernel set's, and on
    fake-cuda TE's multi-stream ones of grouped-GEMM experts."""
    if setup.kernels is None:
        return 0
    return setup.kernels.workspace_bytes() + grouped_workspace(probe.variant, setup.device)
