"""One probe iteration, measured: a micro-batch through megatron's own forward_step and
backward_step, then finalize_model_grads and the optimizer step, each window's peak (and, when
asked, its allocation timeline) read from a MemoryMeter; and what the chunk keeps until its next
forward. capture_megatron.profile.probe builds the chunk (ProbeChunk) and turns what this measures
into a ProfileRecord."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from capture_megatron.config import Kernels, ModelShape, ParallelPlan
from capture_megatron.megatron import versioned
from capture_megatron.megatron.builder import TORCH_DTYPES
from capture_megatron.megatron.training import forward_step
from capture_megatron.records import Timeline

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


def hidden_input(shape: ModelShape, plan: ParallelPlan, device: str) -> torch.Tensor:
    """An activation tensor as stages exchange it: [s / cp (/ tp under SP), b, h] in the model
    dtype."""
    s = shape.seq_length // plan.cp // (plan.tp if plan.sequence_parallel else 1)
    size = (s, plan.micro_batch_size, shape.hidden_size)
    return torch.randn(size, dtype=TORCH_DTYPES[shape.dtype], device=device)


@dataclass
class ProbeChunk:
    """The live objects of a probe (mutable; built by capture_megatron.profile.probe.build)."""

    model: DistributedDataParallel
    """The wrapped chunk (Float16Module inside DDP)."""
    optimizer: MegatronOptimizer
    """Its optimizer."""
    config: TransformerConfig
    """Its TransformerConfig, with the schedule hooks set."""
    shape: ModelShape
    """The model the chunk is cut from (MTP dropped for first and middle probes)."""
    plan: ParallelPlan
    """The probe's parallel plan."""
    first: bool
    """Whether the chunk holds the first stage's embedding."""
    last: bool
    """Whether it holds the last stage's output layer and loss."""
    device: str
    """The torch device of its tensors."""
    kernels: Kernels | None
    """The GPU kernels it was built with (None: the CPU kernel set)."""


def forward(chunk: ProbeChunk, input_tensor: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch through the chunk's forward as the schedule runs it (megatron-core's
    forward_step with the batch its stage gets); returns the output (the loss on the last)."""
    from megatron.core.pipeline_parallel import schedules

    b = chunk.plan.micro_batch_size
    if chunk.kernels is None:
        batch = iter([_batch(chunk.shape, b, chunk.device)])
    else:  # a GPU run: what Megatron-LM's pretrain_gpt hands each stage
        from capture_megatron.megatron.gpu_batch import megatron_lm_batch

        mask = chunk.kernels.create_attention_mask_in_dataloader
        batch = iter(
            [megatron_lm_batch(chunk.shape, b, chunk.first, chunk.last, mask, chunk.device)]
        )
    output, _ = schedules.forward_step(
        forward_step,
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


@dataclass(frozen=True)
class Increments:
    """What one probe iteration measured, in bytes (the ProfileRecord fields of the same names)."""

    input_bytes: int
    """The received input (0 on the first stage)."""
    output_bytes: int
    """The output sent on (0 on the last stage)."""
    saved_bytes: int
    """Live after the forward, the output sent on excluded: what the backward needs."""
    forward_peak: int
    """The forward's peak above the start."""
    backward_peak: int
    """The backward's peak above its start (the received gradient included)."""
    residual_bytes: int
    """Live after the backward above the start, the input counted."""
    step_peak: int
    """The gradient finalize and optimizer step's peak above their start (0 on fake devices)."""
    retained_bytes: int
    """What the chunk keeps until its next forward (MoE routing state; the last iteration)."""
    retained_grad_bytes: int
    """Of retained_bytes, the input gradient's."""


def iteration(
    chunk: ProbeChunk,
    meter: MemoryMeter,
    fake: bool = False,
    timelines: bool = False,
    last: bool = False,
) -> tuple[Increments, tuple[Timeline, ...]]:
    """One micro-batch forward + backward + finalize + optimizer step; the measured increments and,
    with `timelines`, the windows' Timelines. The `last` iteration also measures what the chunk
    retains after it (releasing it; earlier iterations leave it for the next one to start with, as
    the schedule does)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_attr_wrapped_model

    chunk.model.zero_grad_buffer()
    chunk.optimizer.zero_grad()
    hidden = None if chunk.first else hidden_input(chunk.shape, chunk.plan, chunk.device)
    input_tensor = None if hidden is None else hidden.requires_grad_()
    input_bytes = 0 if input_tensor is None else input_tensor.nbytes
    windows = _Windows(meter, timelines)
    start = meter.current()
    with windows.window("forward"):
        output = forward(chunk, input_tensor)
    forward_peak = meter.peak() - start
    grad, output_bytes = None, 0
    if not chunk.last:
        output_bytes = output.nbytes
        grad = torch.randn_like(output)  # what the next stage will send back
        schedules.deallocate_output_tensor(output, chunk.config.deallocate_pipeline_outputs)
    received = grad.nbytes if grad is not None else 0
    before_backward = meter.current() - received
    with windows.window("backward", received):
        input_grad = versioned.backward_step(input_tensor, output, grad, chunk.config)
    backward_peak = meter.peak() - before_backward
    kept_grad = None if input_grad is None else weakref.ref(input_grad)
    del output, grad, input_grad, input_tensor, hidden
    # The model keeps the last received input (set_input_tensor); in the schedule that micro-batch
    # is still in flight when the next forward replaces it, so drop it here or the next probe
    # iteration's forward would look cheaper by the input and its gradient.
    get_attr_wrapped_model(chunk.model, "set_input_tensor")(None)
    residual_bytes = meter.current() - start + input_bytes
    step_peak = 0 if fake else _step(chunk, meter, windows)
    retained, retained_grad = _retained(chunk, meter, kept_grad) if last else (0, 0)
    got = Increments(
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        saved_bytes=before_backward - start,
        forward_peak=forward_peak,
        backward_peak=backward_peak,
        residual_bytes=residual_bytes,
        step_peak=step_peak,
        retained_bytes=retained,
        retained_grad_bytes=retained_grad,
    )
    return got, tuple(windows.lines)


def _step(chunk: ProbeChunk, meter: MemoryMeter, windows: _Windows) -> int:
    """The gradient finalize and optimizer step's peak above their start. Not on fake devices: the
    step reads gradient norms (data), which fake tensors lack; the optimizer's bytes are computed
    from the parameters instead (capture_megatron.forecast.static)."""
    before_step = meter.current()
    finalize = chunk.config.finalize_model_grads_func
    assert finalize is not None, "set_schedule_hooks sets it"
    with windows.window("step"):
        finalize([chunk.model])
        chunk.optimizer.step()
    return meter.peak() - before_step


def _retained(
    chunk: ProbeChunk, meter: MemoryMeter, kept_grad: weakref.ref[torch.Tensor] | None
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


def release(chunk: ProbeChunk, meter: MemoryMeter) -> int:
    """Run a forward without autograd (what the next forward frees, it frees) and return how many
    bytes fewer are live after it."""
    from megatron.core.utils import get_attr_wrapped_model

    before = meter.current()
    with torch.no_grad():
        hidden = None if chunk.first else hidden_input(chunk.shape, chunk.plan, chunk.device)
        output = forward(chunk, hidden)
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
