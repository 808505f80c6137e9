"""Megatron-LM's training set-up around megatron-core, shared by training and the profiler's probes:
DDP wrapping (Float16Module for bf16/fp16, megatron-core's DistributedDataParallel), the optimizer
(get_megatron_optimizer: Adam or SGD; --use-distributed-optimizer shards Adam over DP) with
OptimizerParamScheduler, the schedule hooks train() sets, and forward_step / loss_func as in
Megatron-LM's pretrain_gpt.py (per-token loss summed with the loss mask, reported as (sum, tokens)).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.training import CheckpointOptions, OptimOptions, RunOptions
from capture_megatron.emulate import host_adam
from capture_megatron.megatron.builder import TORCH_DTYPES
from capture_megatron.megatron.schedule import schedule

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

Batch = dict[str, torch.Tensor]
"""One micro-batch as Megatron-LM's get_batch returns it: tokens, labels, loss_mask,
position_ids."""


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked token-loss sum, token count, and the (sum, tokens) pair reported as 'lm loss'."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return (
        loss,
        num_tokens,
        {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])},
    )


def batch_on_this_cp_rank(batch: Batch) -> Batch:
    """This context-parallel rank's part of a micro-batch, as Megatron-LM's get_batch slices it
    (megatron.core.utils.get_batch_on_this_cp_rank: the sequence in 2 x cp chunks, rank r keeps
    chunks r and 2cp-1-r of tokens, labels, loss_mask, position_ids); the batch itself with CP 1."""
    from megatron.core import parallel_state as ps

    from capture_megatron.megatron import versioned

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return batch
    return versioned.batch_on_this_cp_rank(dict(batch))


def forward_step(
    data_iterator: Iterator[Batch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """Megatron's forward_step_func: run a chunk on the next micro-batch (this CP rank's part):
    Megatron-LM's pretrain_gpt forward_step. A CPU micro-batch holds every tensor and no attention
    mask; a GPU one what get_batch hands the stage (megatron/gpu_batch.py).

    With CP each rank's loss is the mean over its own tokens (megatron-core's schedules divide the
    sum by loss_func's token count) and DDP averages gradients over DP x CP, as in Megatron-LM: the
    gradient equals one process's when the CP ranks hold equally many unmasked tokens; the reported
    'lm loss' (sums and counts all-reduced over DP x CP) equals it always."""
    batch = batch_on_this_cp_rank(next(data_iterator))
    output = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        batch.get("attention_mask"),
        labels=batch.get("labels"),
    )
    # a GPU stage's batch holds only what Megatron-LM's get_batch hands it
    # (megatron/gpu_batch.py): no loss mask before the last stage, which alone calls loss_func
    return output, partial(loss_func, batch.get("loss_mask"))  # type: ignore[arg-type]


def wrap_model(
    chunks: list[GPTModel],
    shape: ModelShape,
    plan: ParallelPlan,
    run: RunOptions,
    check_for_nan_in_grad: bool = True,
) -> list[DistributedDataParallel]:
    """Float16Module (bf16/fp16) and megatron DDP around each chunk, then broadcast over DP.

    Probes under FakeTensorMode pass check_for_nan_in_grad=False (the check reads gradient values).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    opts = plan.ddp
    wrapped = []
    for i, chunk in enumerate(chunks):
        # one config per chunk: megatron's DDP writes its resolved bucket size into the config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=opts.grad_dtype(shape.dtype) == "fp32",
            overlap_grad_reduce=opts.overlap_grad_reduce,
            overlap_param_gather=run.overlap_param_gather,
            use_distributed_optimizer=plan.distributed_optimizer,
            num_distributed_optimizer_instances=opts.num_distributed_optimizer_instances,
            # Megatron-LM turns the check off for fp16 with dynamic loss scaling (its NaNs and
            # infs are the scaler's signal; --loss-scale is not modelled, so scaling is dynamic)
            check_for_nan_in_grad=check_for_nan_in_grad and shape.dtype != "fp16",
            bucket_size=bucket_size(opts, chunks),
            pad_buckets_for_high_nccl_busbw=opts.ddp_pad_buckets_for_high_nccl_busbw,
        )
        config = chunk.config
        module = Float16Module(config, chunk) if shape.dtype != "fp32" else chunk
        ddp = DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=module, disable_bucketing=i > 0
        )
        ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def bucket_size(opts: DdpOptions, chunks: list[GPTModel]) -> int | None:
    """DDP's bucket size as Megatron-LM's get_model sets it: --ddp-bucket-size, or the rank's
    parameters over --ddp-num-buckets; None: megatron-core's default (which DDP applies only with
    --overlap-grad-reduce)."""
    if opts.ddp_num_buckets is None:
        return opts.ddp_bucket_size
    return sum(p.nelement() for c in chunks for p in c.parameters()) // opts.ddp_num_buckets


def make_optimizer(
    model: list[DistributedDataParallel],
    shape: ModelShape,
    plan: ParallelPlan,
    optim: OptimOptions,
    train_iters: int,
    use_gloo_process_groups: bool = True,
    resume: CheckpointOptions | None = None,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """get_megatron_optimizer (the plan's Adam or SGD) + OptimizerParamScheduler as Megatron-LM
    configures them (`resume`: its --override-opt_param-scheduler /
    --use-checkpoint-opt_param-scheduler, both off by default as in Megatron-LM). Profiling probes
    run on torch's fake backend, which has no gloo groups: they pass False."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    kind = plan.ddp.optimizer  # flags.args refuses Muon in training
    config = OptimizerConfig(
        optimizer=kind.optimizer,
        sgd_momentum=kind.sgd_momentum,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=shape.dtype == "bf16",
        fp16=shape.dtype == "fp16",
        params_dtype=TORCH_DTYPES[shape.dtype],
        initial_loss_scale=optim.initial_loss_scale,
        use_distributed_optimizer=plan.distributed_optimizer,
    )
    with precision_aware(config, plan.ddp):
        optimizer = get_megatron_optimizer(
            config,
            model,  # type: ignore[arg-type]  # DDP is a MegatronModule; list is invariant
            use_gloo_process_groups=use_gloo_process_groups,
        )
    s = schedule(optim, train_iters, plan.global_batch_size)
    resume = resume or CheckpointOptions()
    wsd = optim.lr_decay_style == "WSD"
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_iters else optim.lr,
        max_lr=s.max_lr,
        min_lr=s.min_lr,
        lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=s.lr_decay_steps,
        lr_decay_style=s.lr_decay_style,
        start_wd=s.start_wd,
        end_wd=s.end_wd,
        wd_incr_steps=s.wd_incr_steps,
        wd_incr_style=s.wd_incr_style,
        use_checkpoint_opt_param_scheduler=resume.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=resume.override_opt_param_scheduler,
        wsd_decay_steps=s.lr_decay_steps if wsd else None,
        lr_wsd_decay_style="linear" if wsd else None,
    )
    return optimizer, scheduler


STATE_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "uint8"}
"""Megatron-LM's names of the optimizer-state dtypes -> torch's (fp8: TE's uint8 Float8Tensor)."""


OFFLOAD_FIELDS = (
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
    "overlap_cpu_optimizer_d2h_h2d",
    "use_torch_optimizer_for_cpu_offload",
    "pin_cpu_grads",
    "pin_cpu_params",
)
"""The OptimizerConfig fields of optimizer CPU offload, as DdpOptions names them."""


@contextlib.contextmanager
def precision_aware(config: OptimizerConfig, opts: DdpOptions) -> Iterator[None]:
    """Megatron-LM's precision-aware optimizer settings on `config` (an OptimizerConfig), and the
    optimizer megatron-core builds for them: Transformer Engine's FusedAdam where TE imports, else
    capture_megatron.emulate.host_adam.HostFusedAdam. megatron-core's OptimizerConfig checks TE's
    FusedAdam signature at construction (and raises without TE), so on a machine without TE the
    settings are set after it, with the flag that config check derives (no fp8 recipe)."""
    if not opts.use_precision_aware_optimizer:
        yield
        return
    dtypes = {
        name: getattr(torch, STATE_DTYPES[getattr(opts, name)])
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    }
    for name, value in dtypes.items():
        setattr(config, name, value)
    for name in OFFLOAD_FIELDS:  # HybridDeviceOptimizer (--optimizer-cpu-offload)
        setattr(config, name, getattr(opts, name))
    config.use_precision_aware_optimizer = True
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
        with host_adam.installed():
            yield
        return
    config.__post_init__()  # megatron-core's own checks, with TE
    yield


def states_in_own_dtypes(config: OptimizerConfig) -> bool:
    """Whether megatron-core keeps the precision-aware optimizer's main parameters and states in
    their own dtypes, set through the optimizer (its OptimizerConfig's derived
    use_precision_aware_optimizer_no_fp8_or_ds_fp8, which precision_aware sets without TE)."""
    return bool(config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def set_schedule_hooks(
    model: list[DistributedDataParallel], optimizer: MegatronOptimizer, run: RunOptions
) -> TransformerConfig:
    """The TransformerConfig hooks Megatron-LM's train() sets before training."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None
    config.finalize_model_grads_func = finalize_model_grads
    if model[0].ddp_config.overlap_grad_reduce:
        no_sync = [m.no_sync for m in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    if run.overlap_param_gather:
        sync = [m.start_param_sync for m in model]
        config.param_sync_func = sync[0] if len(model) == 1 else sync
    return config
