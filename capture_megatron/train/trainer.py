"""Set up a training process the way Megatron-LM does: parallel state, seeds, model, DDP, optimizer.

The model chunks are megatron-core GPTModels (megatron.builder.build_chunks), wrapped and given an
optimizer by capture_megatron.megatron.training (the same set-up the profiler's probes use).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.config.training import (
    BuildOptions,
    CheckpointOptions,
    OptimOptions,
    RunOptions,
)
from capture_megatron.megatron import quiet
from capture_megatron.megatron.backend import Backend
from capture_megatron.megatron.builder import build_chunks
from capture_megatron.megatron.training import make_optimizer, set_schedule_hooks, wrap_model

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class Trainer:
    """The live objects of one training process (mutable: they train)."""

    model: list[DistributedDataParallel]
    """DDP-wrapped model chunks of this rank, one per virtual stage."""
    optimizer: MegatronOptimizer
    """Megatron optimizer (possibly distributed: DistributedOptimizer, or a ChainedOptimizer of
    dense and expert optimizers)."""
    scheduler: OptimizerParamScheduler
    """OptimizerParamScheduler (sample-based steps, like Megatron-LM)."""
    config: TransformerConfig
    """The TransformerConfig shared by this rank's chunks (hooks for the schedules are set on
    it)."""


def init_parallel_state(plan: ParallelPlan, seed: int) -> None:
    """megatron parallel_state for `plan` and Megatron-LM's seeding (seed + 100 * pp_rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None,
        context_parallel_size=plan.cp,
        expert_model_parallel_size=plan.ep,
        expert_tensor_parallel_size=plan.expert_tp,
        num_distributed_optimizer_instances=plan.ddp.num_distributed_optimizer_instances,
    )
    rank_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    model_parallel_cuda_manual_seed(rank_seed)
    quiet.initialize_rerun_state_machine()


def build_trainer(
    shape: ModelShape,
    plan: ParallelPlan,
    optim: OptimOptions,
    run: RunOptions,
    build: BuildOptions,
    backend: Backend,
    resume: CheckpointOptions | None = None,
) -> Trainer:
    """Everything a rank needs to run train steps (parallel state must be initialised); `resume`
    tells the scheduler which schedule a resume follows when it differs from the checkpoint's."""
    chunks = build_chunks(shape, plan, build, backend=backend, seed=run.seed)
    model = wrap_model(chunks, shape, plan, run)
    optimizer, scheduler = make_optimizer(model, shape, plan, optim, run.train_iters, resume=resume)
    config = set_schedule_hooks(model, optimizer, run)
    return Trainer(model=model, optimizer=optimizer, scheduler=scheduler, config=config)
