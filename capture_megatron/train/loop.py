"""One optimizer step and the iteration loop, on megatron-core's pipeline schedules.

forward_step (capture_megatron.megatron.training) follows Megatron-LM's pretrain_gpt.py; train_step
follows megatron/training/training.py: zero the DDP grad buffers, run get_forward_backward_func()
(no pipelining, 1F1B, or interleaved 1F1B), optimizer.step (finalize_model_grads does the DP / SP /
embedding all-reduces), then the LR scheduler."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.megatron.training import Batch, forward_step
from capture_megatron.train.report import IterationStats

if TYPE_CHECKING:
    from capture_megatron.train.trainer import Trainer


class OnStep(Protocol):
    """What run_iterations calls after each iteration `it` (and once with final=True when there
    is nothing left to train); True: leave the loop."""

    def __call__(self, it: int, final: bool = False) -> bool:
        """Checkpoint when due; whether to stop."""


@dataclass(frozen=True)
class StepResult:
    """What one train_step returns."""

    loss: float
    """Global-batch mean token loss (the same on every rank)."""
    grad_norm: float
    """Gradient norm before clipping."""
    lr: float
    """Learning rate applied in this step."""
    skipped: bool
    """True when the optimizer skipped the update (fp16 overflow)."""


def _global_loss(reports: list[dict[str, torch.Tensor]], device: str) -> float:
    """Token-mean loss of the whole global batch, known on every rank afterwards (sums and token
    counts all-reduced over DP x CP, as Megatron-LM's train_step reduces 'lm loss', then over
    the pipeline)."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(2, dtype=torch.float64, device=device)
    for report in reports:
        total += report["lm loss"].to(torch.float64)
    torch.distributed.all_reduce(
        total, group=ps.get_data_parallel_group(with_context_parallel=True)
    )
    torch.distributed.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return float(total[0] / total[1].clamp(min=1))


def train_step(
    trainer: Trainer, iterators: list[Iterator[Batch]], shape: ModelShape, plan: ParallelPlan
) -> StepResult:
    """One optimizer step over the global batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if plan.vpp > 1 else iterators[0],
        model=trainer.model if plan.vpp > 1 else trainer.model[0],
        num_microbatches=plan.num_microbatches,
        seq_length=shape.seq_length,
        micro_batch_size=plan.micro_batch_size,
        decoder_seq_length=shape.seq_length,
        forward_only=False,
    )
    lr = trainer.optimizer.param_groups[0]["lr"]
    ok, grad_norm, _ = trainer.optimizer.step()
    if ok:
        trainer.scheduler.step(increment=plan.global_batch_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return StepResult(
        loss=_global_loss(reports, device),
        grad_norm=float(grad_norm or 0.0),
        lr=float(lr),
        skipped=not ok,
    )


def log_line(it: int, total: int, step: StepResult, seconds: float, tokens: int) -> str:
    """Megatron-style one-line iteration log."""
    return (
        f"iteration {it:6d}/{total} | loss {step.loss:.6f} | grad norm {step.grad_norm:.4f} | "
        f"lr {step.lr:.3e} | step {seconds:.3f} s | {tokens / seconds:,.0f} tokens/s"
        + (" | skipped (overflow)" if step.skipped else "")
    )


def run_iterations(
    trainer: Trainer,
    iterators: list[Iterator[Batch]],
    shape: ModelShape,
    plan: ParallelPlan,
    start: int,
    stop: int,
    log_interval: int,
    on_step: OnStep | None = None,
    progress: bool = False,
) -> list[IterationStats]:
    """Train iterations start+1..stop; `on_step(it)` runs after each (checkpointing) and
    returns True to stop early (--exit-interval). Returns the stats of the iterations run."""
    from tqdm import tqdm

    from capture_megatron.train.dist_env import is_logging_rank

    tokens = plan.global_batch_size * shape.seq_length
    stats: list[IterationStats] = []
    bar = tqdm(
        total=stop - start,
        desc="training",
        unit="it",
        disable=not (progress and is_logging_rank()),
        dynamic_ncols=True,
    )
    for it in range(start + 1, stop + 1):
        t0 = time.perf_counter()
        step = train_step(trainer, iterators, shape, plan)
        seconds = time.perf_counter() - t0
        stats.append(
            IterationStats(
                iteration=it,
                loss=step.loss,
                grad_norm=step.grad_norm,
                lr=step.lr,
                step_seconds=seconds,
                tokens_per_second=tokens / seconds,
            )
        )
        if is_logging_rank() and (it % log_interval == 0 or it == stop):
            line = log_line(it, stop, step, seconds, tokens)
            print(line, flush=True) if bar.disable else bar.write(line)
        bar.update(1)
        if on_step is not None and on_step(it):
            break
    bar.close()
    return stats
