"""Atomic, reshardable checkpoints with megatron.core.dist_checkpointing (torch_dist format).

Layout of --save DIR (Megatron-LM's): ``iter_0000003/`` per checkpoint and
``latest_checkpointed_iteration.txt`` naming the newest complete one. A save writes into
``iter_0000003.partial/``; only when every rank has finished does rank 0 rename it and then replace
the tracker file atomically (write + fsync + os.replace). A run killed during a save therefore
leaves the previous checkpoint as the loadable one (a stale .partial directory is removed by the
next save). Model weights and optimizer state are saved fully reshardable (the distributed optimizer
with 'fully_reshardable'), so a checkpoint loads under another TP / PP / VPP / layout / DP, within
the rules of train.resume (same padded vocabulary; Megatron-LM's rule for the LR schedule), which
preflight checks before launch and load_checkpoint again on every rank."""

from __future__ import annotations

import glob
import os
import shutil
import time
import warnings

import torch

from capture_megatron.config import ModelShape, ParallelPlan, TrainConfig
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import ckpt_fixes
from capture_megatron.megatron.ckpt_rechain import plain_values, rechained_common
from capture_megatron.megatron.schedule import Schedule, schedule
from capture_megatron.train.resume import SavedRun, check_resume, loads_optimizer

TRACKER = "latest_checkpointed_iteration.txt"
PAUSE_ENV = "CAPTURE_MEGATRON_TEST_SAVE_PAUSE"
"""Test hook: 'SECONDS' or 'SECONDS@ITERATION' to sleep after the shards are written and before the
checkpoint is published (so a test can kill a run in the middle of a save)."""


def iteration_dir(root: str, iteration: int) -> str:
    """Directory of one checkpoint."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """Iteration named by the tracker file, or None when there is no complete checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit() or not os.path.isdir(iteration_dir(root, int(text))):
        raise CaptureError(
            f"--load {root}: {TRACKER} says {text!r} but no such checkpoint directory exists"
        )
    return int(text)


def _metadata(plan: ParallelPlan) -> dict:
    from megatron.core import parallel_state as ps

    meta = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }
    if plan.distributed_optimizer:
        meta["distrib_optim_sharding_type"] = "fully_reshardable"
    return meta


def _rng_shards(plan: ParallelPlan) -> tuple[int, ...]:
    """How the RNG states are sharded, as Megatron-LM's get_rng_state shards them: by (PP, TP),
    and by DP too when EP > 1 (the expert-parallel RNG differs between the DP ranks of an EP
    group)."""
    return (plan.pp, plan.tp, plan.dp * plan.cp) if plan.ep > 1 else (plan.pp, plan.tp)


def _rng_object(plan: ParallelPlan):
    """This rank's RNG states as a ShardedObject indexed (pp_rank, tp_rank[, dp_rank]) by
    _rng_shards, replicated over DP x CP when not indexed by it (Megatron-LM's get_rng_state: CP
    ranks of a TP/PP position hold the same states)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    shards = _rng_shards(plan)
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject(
        "rng_state",
        state,
        shards,
        offset + ((dp_rank,) if len(shards) == 3 else ()),
        replica_id=0 if len(shards) == 3 else dp_rank,
    )


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _sharded_state(
    trainer, plan: ParallelPlan, with_optim: bool, with_rng: bool, loading: bool
) -> dict:
    """Megatron-LM's checkpoint structure, built on the unwrapped GPTModels (no DDP/Float16
    prefixes)."""
    from megatron.core.utils import unwrap_model

    ckpt_fixes.apply()
    meta = _metadata(plan)
    state = {}
    chunks = unwrap_model(trainer.model)
    for i, chunk in enumerate(chunks):
        state[_model_key(i, len(chunks))] = chunk.sharded_state_dict(metadata=meta)
    if with_optim:
        state["optimizer"] = trainer.optimizer.sharded_state_dict(
            state, is_loading=loading, metadata=meta
        )
        state["opt_param_scheduler"] = trainer.scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_object(plan)
    return state


def _publish(root: str, partial: str, final: str, iteration: int) -> None:
    """Rank 0: rename the finished checkpoint into place, then atomically point the tracker at
    it."""
    os.rename(partial, final)
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str, iteration: int, trainer, shape: ModelShape, plan: ParallelPlan, consumed_samples: int
) -> str:
    """Save an atomic checkpoint of iteration `iteration`; returns its directory."""
    from megatron.core import dist_checkpointing

    final, partial = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".partial"
    if os.path.isdir(final):
        return final
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        for stale in glob.glob(os.path.join(root, "iter_*.partial")):
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(partial)
    torch.distributed.barrier()
    state = _sharded_state(trainer, plan, with_optim=True, with_rng=True, loading=False)
    state.update(
        iteration=iteration,
        consumed_samples=consumed_samples,
        checkpoint_version=3.0,
        shape=shape.to_json(),
        plan=plan.to_json(),
        vocab_size=shape.vocab_size,
        padded_vocab_size=shape.padded_vocab(plan.tp),
    )
    dist_checkpointing.save(state, partial, content_metadata=_content_metadata(plan))
    seconds, _, at = os.environ.get(PAUSE_ENV, "").partition("@")
    if seconds and (not at or int(at) == iteration):
        time.sleep(float(seconds))
    torch.distributed.barrier()
    if rank0:
        _publish(root, partial, final, iteration)
    torch.distributed.barrier()
    return final


def _content_metadata(plan: ParallelPlan) -> dict:
    meta = _metadata(plan)
    meta.pop("dp_cp_group")
    return meta


def load_checkpoint(cfg: TrainConfig, trainer) -> tuple[int, int]:
    """Resume from the newest complete checkpoint in --load; returns (iteration,
    consumed_samples). What the resume may change is checked first (train.resume)."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    opts, plan = cfg.checkpoint, cfg.plan
    iteration = latest_iteration(opts.load)
    if iteration is None:
        if opts.exit_on_missing_checkpoint:
            raise CaptureError(f"--load {opts.load}: no checkpoint found ({TRACKER} missing)")
        return 0, 0
    path = iteration_dir(opts.load, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    saved = SavedRun.from_common(path, common)
    current = Schedule.from_state(trainer.scheduler.state_dict())
    check_resume(saved, common, cfg, current)
    with_optim = loads_optimizer(opts)
    with_rng = not (opts.no_load_rng or opts.finetune) and _rng_shards(saved.plan) == _rng_shards(
        plan
    )
    if with_optim:
        _allocate_distributed_optimizer_state(trainer.optimizer)
    state = _sharded_state(trainer, plan, with_optim=with_optim, with_rng=with_rng, loading=True)
    # the optimizer's common state in this run's chain (EP 1 <-> EP > 1: ckpt_rechain)
    common_strategy = rechained_common(plain_values(state["optimizer"])) if with_optim else None
    loaded = dist_checkpointing.load(state, path, common_strategy=common_strategy)
    chunks = unwrap_model(trainer.model)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
    if with_optim:
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        ckpt_fixes.untie_adam_steps(trainer.optimizer)
        trainer.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        _restore_rng(loaded["rng_state"])
    if opts.finetune:
        return 0, 0
    return int(common["iteration"]), int(common["consumed_samples"])


def _allocate_distributed_optimizer_state(optimizer) -> None:
    """Give an untouched DistributedOptimizer its Adam state before loading into it.

    Without Apex/Transformer Engine, megatron-core 0.16.1's DistributedOptimizer.state_dict() reads
    the 'step' of every allocated Adam state and asserts there is exactly one value; a fresh
    optimizer has none, so building the sharded state dict for loading fails. Megatron's own
    _init_optimizer_states_with_dummy_values (one zero-gradient step) allocates it; every value it
    touches is then overwritten by the checkpoint."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def preflight(cfg: TrainConfig) -> None:
    """Before launching: check the newest checkpoint under --load against `cfg` (nothing to
    check without --load or when it holds no checkpoint yet)."""
    if not cfg.checkpoint.load:
        return
    with warnings.catch_warnings():  # megatron-core warns at import that TE / Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core import dist_checkpointing

    iteration = latest_iteration(cfg.checkpoint.load)
    if iteration is None:
        return
    path = iteration_dir(cfg.checkpoint.load, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    current = schedule(cfg.optim, cfg.run.train_iters, cfg.plan.global_batch_size)
    check_resume(SavedRun.from_common(path, common), common, cfg, current)
