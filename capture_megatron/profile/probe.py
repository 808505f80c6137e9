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
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from capture_megatron.config import Kernels, ModelShape, ParallelPlan
from capture_megatron.config.training import BuildOptions, OptimOptions, RunOptions
from capture_megatron.megatron.attention import rotary_tables_built_in_fp32
from capture_megatron.megatron.backend import Backend
from capture_megatron.megatron.builder import TORCH_DTYPES, build_gpt, transformer_config
from capture_megatron.megatron.training import (
    forward_step,
    make_optimizer,
    set_schedule_hooks,
    wrap_model,
)
from capture_megatron.predict.static import chunk_static
from capture_megatron.profile import held
from capture_megatron.profile.experts import (
    expert_mask,
    grouped_workspace,
    reset_aux_loss_tracker,
)
from capture_megatron.profile.offload import offload_tensors
from capture_megatron.profile.probed import model_shape, parallel_plan
from capture_megatron.profile.setup import Setup
from capture_megatron.records import Probe, ProfileRecord, Timeline

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from capture_megatron.memory.meter import MemoryMeter


def _batch(shape: ModelShape, b: int, device: str) -> dict[str, torch.Tensor]:
    s = shape.seq_length
    tokens = torch.randint(0, shape.vocab_size, (b, s), device=device)
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, 1),
        "loss_mask": torch.ones(b, s, device=device),
        "position_ids": torch.arange(s, device=device).expand(b, s).contiguous(),
    }


def _hidden(shape: ModelShape, plan: ParallelPlan, device: str) -> torch.Tensor:
    """An activation tensor as stages exchange it: [s / cp (/ tp under SP), b, h] in the model
    dtype."""
    s = shape.seq_length // plan.cp // (plan.tp if plan.sequence_parallel else 1)
    size = (s, plan.micro_batch_size, shape.hidden_size)
    return torch.randn(size, dtype=TORCH_DTYPES[shape.dtype], device=device)


@dataclass
class _Chunk:
    """The live objects of a probe (mutable)."""

    model: DistributedDataParallel
    optimizer: MegatronOptimizer
    config: TransformerConfig
    shape: ModelShape
    plan: ParallelPlan
    first: bool
    last: bool
    device: str
    kernels: Kernels | None


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


def build(probe: Probe, setup: Setup) -> _Chunk:
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
    return _Chunk(model[0], optimizer, config, shape, plan, first, last, device, setup.kernels)


def _forward(chunk: _Chunk, input_tensor: torch.Tensor | None) -> torch.Tensor:
    from megatron.core.pipeline_parallel import schedules

    b, step = chunk.plan.micro_batch_size, forward_step
    if chunk.kernels is None:
        batch = iter([_batch(chunk.shape, b, chunk.device)])
    else:  # a GPU run: what Megatron-LM's pretrain_gpt hands each stage
        from capture_megatron.megatron.gpu_batch import megatron_lm_batch, megatron_lm_forward_step

        mask = chunk.kernels.create_attention_mask_in_dataloader
        batch = iter(
            [megatron_lm_batch(chunk.shape, b, chunk.first, chunk.last, mask, chunk.device)]
        )
        step = megatron_lm_forward_step
    output, _ = schedules.forward_step(
        step,
        batch,
        chunk.model,
        1,
        input_tensor,
        [],
        chunk.config,
        cp_group_size=chunk.plan.cp,
        is_last_stage=chunk.last,
    )
    return output


class _Windows:
    """Measures the windows of one iteration: each one's peak above a base and, when asked, its
    timeline.

    The garbage collector is off inside a window, so that a collection of reference cycles does not
    release storages at a moment that depends on unrelated allocations (timelines of different
    shapes would not align, and the peak would depend on when Python last collected)."""

    def __init__(self, meter: MemoryMeter, timelines: bool) -> None:
        self.meter, self.timelines = meter, timelines
        self.lines: list[Timeline] = []

    @contextlib.contextmanager
    def window(self, name: str, offset: int = 0) -> Iterator[None]:
        """Measure the body's peak above the bytes live at entry; `offset` bytes before the window
        count."""
        collecting = gc.isenabled()
        gc.disable()
        self.meter.reset_peak()
        if self.timelines:
            self.meter.start_events()
        try:
            yield
        finally:
            if collecting:
                gc.enable()
            events = self.meter.take_events() if self.timelines else None
        if events is not None:
            ops, nbytes, origins = zip(*events) if events else ((), (), ())
            self.lines.append(Timeline(name, tuple(ops), tuple(nbytes), offset, tuple(origins)))


def iteration(
    chunk: _Chunk,
    meter: MemoryMeter,
    fake: bool = False,
    timelines: bool = False,
    last: bool = False,
) -> tuple[dict[str, int], tuple[Timeline, ...]]:
    """One micro-batch forward + backward + finalize + optimizer step; the measured increments and,
    with `timelines`, the windows' Timelines. The `last` iteration also measures what the chunk
    retains after it (releasing it; earlier iterations leave it for the next one to start with, as
    the schedule does)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_attr_wrapped_model

    chunk.model.zero_grad_buffer()
    chunk.optimizer.zero_grad()
    hidden = None if chunk.first else _hidden(chunk.shape, chunk.plan, chunk.device)
    input_tensor = None if hidden is None else hidden.requires_grad_()
    out = {"input_bytes": 0 if input_tensor is None else input_tensor.nbytes}
    windows = _Windows(meter, timelines)
    start = meter.current()
    with windows.window("forward"):
        output = _forward(chunk, input_tensor)
    out["forward_peak"] = meter.peak() - start
    grad = None
    if not chunk.last:
        out["output_bytes"] = output.nbytes
        grad = torch.randn_like(output)  # what the next stage will send back
        schedules.deallocate_output_tensor(output, chunk.config.deallocate_pipeline_outputs)
    received = grad.nbytes if grad is not None else 0
    before_backward = meter.current() - received
    out["saved_bytes"] = before_backward - start
    with windows.window("backward", received):
        input_grad = schedules.backward_step(input_tensor, output, grad, None, chunk.config)
    out["backward_peak"] = meter.peak() - before_backward
    kept_grad = None if input_grad is None else weakref.ref(input_grad)
    del output, grad, input_grad, input_tensor, hidden
    # The model keeps the last received input (set_input_tensor); in the schedule that micro-batch
    # is still in flight when the next forward replaces it, so drop it here or the next probe
    # iteration's forward would look cheaper by the input and its gradient.
    get_attr_wrapped_model(chunk.model, "set_input_tensor")(None)
    out["residual_bytes"] = meter.current() - start + out["input_bytes"]
    out["step_peak"] = (
        0  # fake: the step reads gradient norms (data), which fake tensors lack; optimizer
    )
    if (
        not fake
    ):  # bytes are computed from the parameters (capture_megatron.predict.static) instead.
        before_step = meter.current()
        finalize = chunk.config.finalize_model_grads_func
        assert finalize is not None, "set_schedule_hooks sets it"
        with windows.window("step"):
            finalize([chunk.model])
            chunk.optimizer.step()
        out["step_peak"] = meter.peak() - before_step
    out["retained_bytes"], out["retained_grad_bytes"] = (
        _retained(chunk, meter, kept_grad) if last else (0, 0)
    )
    return out, tuple(windows.lines)


def _retained(
    chunk: _Chunk, meter: MemoryMeter, kept_grad: weakref.ref[torch.Tensor] | None
) -> tuple[int, int]:
    """(bytes, of them the input gradient's) the chunk keeps after its backward until its next
    forward, measured by releasing them with a forward without autograd.

    Megatron's MoE token dispatchers keep the last pass's routing tensors (`probs`,
    `routing_map`); after a backward those carry the autograd graph of the pass, which reaches the
    leaves it started from: a recomputed layer's detached input and the chunk's received input,
    whose storage and `.grad` (the input gradient) stay alive until the layer's next forward
    replaces them. Dense layers keep no graph between passes (measured 0, tests/unit/
    test_retained.py), so only chunks with MoE layers are measured."""
    if not chunk.shape.moe.enabled:
        return 0, 0
    grad = kept_grad() if kept_grad is not None else None
    grad_bytes = 0 if grad is None else grad.nbytes
    del grad
    return release(chunk, meter), grad_bytes


def release(chunk: _Chunk, meter: MemoryMeter) -> int:
    """Run a forward without autograd (what the next forward frees, it frees) and return how many
    bytes fewer are live after it."""
    from megatron.core.utils import get_attr_wrapped_model

    before = meter.current()
    with torch.no_grad():
        hidden = None if chunk.first else _hidden(chunk.shape, chunk.plan, chunk.device)
        output = _forward(chunk, hidden)
    del output, hidden
    get_attr_wrapped_model(chunk.model, "set_input_tensor")(None)
    drop_checkpoints(chunk.model)
    return before - meter.current()


def drop_checkpoints(model: torch.nn.Module) -> None:
    """Forget what the forward without autograd left in megatron-core's CheckpointWithoutOutput
    objects (selective recompute of layernorm, moe_act, mla_up_proj keeps them on the modules):
    without a backward to recompute them they would keep their saved inputs, which a training
    step's backward releases (it sets their ctx to None)."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, CheckpointWithoutOutput):
                setattr(module, name, None)


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
        input_bytes=got["input_bytes"],
        output_bytes=got.get("output_bytes", 0),
        saved_bytes=got["saved_bytes"],
        forward_peak=got["forward_peak"],
        backward_peak=got["backward_peak"],
        residual_bytes=got["residual_bytes"],
        step_peak=got["step_peak"],
        buffers=held.buffers_held(setup.device == "fake-cuda"),
        workspace_bytes=_workspaces(probe, setup),
        timelines=lines,
        param_expert=expert_mask(chunk.model),
        retained_bytes=got["retained_bytes"],
        retained_grad_bytes=got["retained_grad_bytes"],
        routing_state_bytes=held.routing_state_bytes(chunk.model, torch.device(chunk.device).type),
        layer_buffer_bytes=held.layer_buffer_bytes(chunk.model, torch.device(chunk.device).type),
        fp8_state_bytes=held.fp8_state_bytes(chunk.model),
        param_fp8=held.fp8_param_mask(chunk.model, setup.kernels),
    )
    if probe.kind == "middle" and probe.layers == 1 and not probe.recompute_layers:
        record = dataclasses.replace(record, offload_tensors=_offloaded(chunk))
    del chunk
    gc.collect()
    return record


def _offloaded(chunk: _Chunk) -> tuple:
    """What fine-grained activation offloading would move off the device from the chunk's layer
    (capture_megatron.profile.offload), by one more forward; what it leaves is dropped."""
    from megatron.core.utils import get_attr_wrapped_model

    hidden = _hidden(chunk.shape, chunk.plan, chunk.device).requires_grad_()
    rows = offload_tensors(chunk.model, lambda: _forward(chunk, hidden))
    get_attr_wrapped_model(chunk.model, "set_input_tensor")(None)
    drop_checkpoints(chunk.model)
    return rows


def _workspaces(probe: Probe, setup: Setup) -> int:
    """GEMM workspaces the process keeps that no probe allocates: the kernel set's, and on
    fake-cuda TE's multi-stream ones of grouped-GEMM experts."""
    if setup.kernels is None:
        return 0
    return setup.kernels.workspace_bytes() + grouped_workspace(probe.variant, setup.device)
