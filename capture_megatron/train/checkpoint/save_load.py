"""Atomic, reshardable checkpoints with megatron.core.dist_checkpointing (torch_dist format).

Layout of --save DIR (Megatron-LM's): ``iter_0000003/`` per checkpoint and
``latest_checkpointed_iteration.txt`` naming the newest complete one. The run's rank 0 holds the
directory's lock (train.checkpoint.lock, train.checkpoint.claim). A save writes into
``iter_0000003.partial/``; only when every rank has finished does rank 0 rename it into place --
never over an existing directory: a run that would replace checkpoints it did not write is refused
before it starts (train.checkpoint.directory.refuse_replacing) -- and then replace the tracker
file atomically (write + fsync + os.replace). A run killed during a save therefore leaves the
previous checkpoint as the loadable one (its .partial directory is removed by the next run that
takes the lock), and one killed between the rename and the tracker's update leaves a complete
checkpoint that the next resume takes (directory.PUBLISHING). Before publishing, the ranks hash
every file into the checkpoint's checksum file; a load verifies them and falls back to the previous
sound checkpoint (train.checkpoint.verify), and reads nothing that could run code
(train.checkpoint.trust). A save that fails is one paragraph naming its cause (no space,
permission, another writer) and the last complete checkpoint, which stays untouched.

Model weights and optimizer state are saved fully reshardable (the distributed optimizer with
'fully_reshardable'), so a checkpoint loads under another TP / PP / VPP / layout / DP, within the
rules of train.resume (same padded vocabulary; Megatron-LM's rule for the LR schedule; the
optimizer and precision settings), which claim.preflight checks before launch and load_checkpoint
again on every rank."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from capture_megatron.config import ParallelPlan, TrainConfig
from capture_megatron.errors import CaptureError
from capture_megatron.megatron.schedule import Schedule
from capture_megatron.train.checkpoint import megatron_fixes as ckpt_fixes
from capture_megatron.train.checkpoint import trust as ckpt_safe
from capture_megatron.train.checkpoint import verify as ckpt_verify
from capture_megatron.train.checkpoint.directory import (
    PUBLISHING,
    TRACKER,
    fsync_dir,
    iteration_dir,
    latest_iteration,
    write_tracker,
)
from capture_megatron.train.checkpoint.rechain import plain_values, rechained_common
from capture_megatron.train.dist_env import lost_a_peer
from capture_megatron.train.resume import SavedRun, check_resume, loads_optimizer
from capture_megatron.train.resume_settings import saved_settings

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.optimizer import MegatronOptimizer

    from capture_megatron.train.trainer import Trainer

__all__ = [
    "PAUSE_ENV",
    "TRACKER",
    "iteration_dir",
    "latest_iteration",
    "load_checkpoint",
    "save_checkpoint",
]

PAUSE_ENV = "CAPTURE_MEGATRON_TEST_SAVE_PAUSE"
"""Test hook: 'SECONDS', 'SECONDS@ITERATION' or 'SECONDS@ITERATION:published' to sleep after the
shards are written and before the checkpoint is published (so a test can kill a run in the middle
of a save), or with ':published' after its directory is renamed into place and before the tracker
file names it."""


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


def _rng_object(plan: ParallelPlan) -> ShardedObject:
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
    trainer: Trainer, plan: ParallelPlan, with_optim: bool, with_rng: bool, loading: bool
) -> dict[str, Any]:
    """Megatron-LM's checkpoint structure, built on the unwrapped GPTModels (no DDP/Float16
    prefixes)."""
    from megatron.core.utils import unwrap_model

    ckpt_fixes.apply()
    meta = _metadata(plan)
    state: dict[str, Any] = {}
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


def _pause(iteration: int, stage: str) -> None:
    """The PAUSE_ENV test hook."""
    seconds, _, rest = os.environ.get(PAUSE_ENV, "").partition("@")
    at, _, when = rest.partition(":")
    if seconds and (not at or int(at) == iteration) and (when or "written") == stage:
        time.sleep(float(seconds))


def _publish(root: str, partial: str, final: str, iteration: int) -> None:
    """Rank 0: rename the finished checkpoint into place -- never over an existing directory
    (SaveError: another program wrote it meanwhile) -- then atomically point the tracker at it;
    PUBLISHING names the iteration in between."""
    if os.path.exists(final):
        raise ckpt_verify.SaveError(ckpt_verify.race_text(root, iteration, True))
    note = os.path.join(root, PUBLISHING)
    with open(note, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, final)
    fsync_dir(root)
    _pause(iteration, "published")
    write_tracker(root, iteration)
    os.remove(note)


def _write_checksums(partial: str) -> None:
    """Every rank hashes its share of the written files; rank 0 writes the checksum file."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    names = ckpt_verify.files_to_hash(partial)
    mine = ckpt_verify.digests(partial, ckpt_verify.share(names, rank, world))
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        ckpt_verify.write_manifest(partial, {k: v for part in gathered for k, v in part.items()})


def _prepare(root: str, partial: str, iteration: int) -> None:
    """Rank 0, before a save: the directory and this save's .partial (claim.tidy removed those
    of runs that are gone; one there now was made by another program: a race)."""
    os.makedirs(root, exist_ok=True)
    try:
        os.makedirs(partial)
    except FileExistsError:
        raise ckpt_verify.SaveError(ckpt_verify.race_text(root, iteration, False)) from None


def _on_rank0(step: Callable[[], None], root: str, iteration: int, partial: str) -> None:
    """Run one step of a save on rank 0; when it fails every rank raises its paragraph
    (collective: no rank waits at a barrier for a rank 0 that gave up)."""
    text = [""]
    if torch.distributed.get_rank() == 0:
        try:
            step()
        except ckpt_verify.SaveError as err:
            text = [str(err)]
        except Exception as err:
            text = [str(_save_failed(root, iteration, partial, err, True))]
    torch.distributed.broadcast_object_list(text, src=0)
    if text[0]:  # printed once, by rank 0
        raise (ckpt_verify.SaveError if torch.distributed.get_rank() == 0 else CaptureError)(
            text[0]
        )


def save_checkpoint(
    root: str, iteration: int, trainer: Trainer, cfg: TrainConfig, consumed: int
) -> str:
    """Save an atomic checkpoint of iteration `iteration` (never over an existing one); returns
    its directory. A failed save is one CaptureError naming its cause and the last complete
    checkpoint, which it leaves in place."""
    from megatron.core import dist_checkpointing

    final, partial = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".partial"
    _on_rank0(lambda: _prepare(root, partial, iteration), root, iteration, partial)
    shape, plan = cfg.shape, cfg.plan
    try:
        state = _sharded_state(trainer, plan, with_optim=True, with_rng=True, loading=False)
        ckpt_fixes.writers_die_with_rank()
        state.update(
            iteration=iteration,
            consumed_samples=consumed,
            checkpoint_version=3.0,
            shape=shape.to_json(),
            plan=plan.to_json(),
            vocab_size=shape.vocab_size,
            padded_vocab_size=shape.padded_vocab(plan.tp),
            **saved_settings(cfg),
        )
        dist_checkpointing.save(state, partial, content_metadata=_content_metadata(plan))
        _pause(iteration, "written")
        torch.distributed.barrier()
        _write_checksums(partial)
        torch.distributed.barrier()
    except CaptureError:
        raise
    except (Exception, CheckpointException) as err:
        raise _save_failed(
            root, iteration, partial, err, torch.distributed.get_rank() == 0
        ) from None
    _on_rank0(lambda: _publish(root, partial, final, iteration), root, iteration, partial)
    return final


def _save_failed(
    root: str, iteration: int, partial: str, err: BaseException, rank0: bool
) -> ckpt_verify.SaveError:
    """The CaptureError of a failed save; rank 0 removes the incomplete directory. A save that
    failed because another rank's process ended says so (`lost_peer`: the rank waits for torchrun
    to name the one that died, entry.main)."""
    free = shutil.disk_usage(root).free if os.path.isdir(root) else None
    if rank0:
        shutil.rmtree(partial, ignore_errors=True)
    try:
        last = latest_iteration(root)
    except CaptureError:
        last = None
    if lost_a_peer(err):
        lost = ckpt_verify.SaveError(ckpt_verify.interrupted_text(root, iteration, last))
        lost.lost_peer = True
        return lost
    return ckpt_verify.SaveError(ckpt_verify.save_error_text(root, iteration, err, free, last))


def _content_metadata(plan: ParallelPlan) -> dict:
    meta = _metadata(plan)
    meta.pop("dp_cp_group")
    return meta


def load_checkpoint(cfg: TrainConfig, trainer: Trainer, iteration: int) -> tuple[int, int]:
    """Load checkpoint `iteration` of --load (start_point's); returns (iteration,
    consumed_samples). What the resume may change is checked first (train.resume)."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from capture_megatron.train.dist_env import is_logging_rank

    opts, plan = cfg.checkpoint, cfg.plan
    path = iteration_dir(opts.load, iteration)
    common = ckpt_safe.load_common(path)
    saved = SavedRun.from_common(path, common)
    current = Schedule.from_state(trainer.scheduler.state_dict())
    for note in check_resume(saved, common, cfg, current):
        if is_logging_rank():
            print(f"note: {note}", flush=True)
    with_optim = loads_optimizer(opts)
    with_rng = not (opts.no_load_rng or opts.finetune) and _rng_shards(saved.plan) == _rng_shards(
        plan
    )
    if with_optim:
        _allocate_distributed_optimizer_state(trainer.optimizer)
    state = _sharded_state(trainer, plan, with_optim=with_optim, with_rng=with_rng, loading=True)
    # the optimizer's common state in this run's chain (EP 1 <-> EP > 1: rechain)
    common_strategy = rechained_common(plain_values(state["optimizer"])) if with_optim else None
    ckpt_safe.install()
    try:
        loaded = dist_checkpointing.load(state, path, common_strategy=common_strategy)
    except (Exception, CheckpointException) as err:
        raise ckpt_safe.load_failed(path, err) from None
    # a tuple only for a strict mode that returns the missing/unexpected keys too (not asked)
    assert isinstance(loaded, dict)
    chunks = unwrap_model(trainer.model)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
    if with_optim:
        fresh = _group_lrs(trainer.optimizer)
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        ckpt_fixes.untie_adam_steps(trainer.optimizer)
        _set_adam(trainer.optimizer, cfg)
        if opts.override_opt_param_scheduler:
            _set_group_lrs(trainer.optimizer, fresh)
        trainer.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        _restore_rng(loaded["rng_state"])
    if opts.finetune:
        return 0, 0
    return int(common["iteration"]), int(common["consumed_samples"])


def _group_lrs(optimizer: MegatronOptimizer) -> list[tuple[float | None, float | None]]:
    """Each param group's (max_lr, min_lr): megatron-core 0.16.1's scheduler reads them from
    the groups before its own values."""
    return [(g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups]


def _set_group_lrs(
    optimizer: MegatronOptimizer, lrs: list[tuple[float | None, float | None]]
) -> None:
    """Give the loaded param groups this run's learning rates again.

    Loading the optimizer restores its param groups as saved, 'max_lr' and 'min_lr' included, and
    the scheduler takes a group's 'max_lr' over its own: with --override-opt_param-scheduler a new
    --lr / --min-lr would otherwise be dropped without a word (the schedule's shape was this
    run's, its peak the checkpoint's)."""
    groups = optimizer.param_groups
    for group, (max_lr, min_lr) in zip(groups, lrs, strict=len(groups) == len(lrs)):
        for key, value in (("max_lr", max_lr), ("min_lr", min_lr)):
            if value is not None:
                group[key] = value


def _set_adam(optimizer: MegatronOptimizer, cfg: TrainConfig) -> None:
    """This run's Adam betas and epsilon in the loaded param groups (the load restored the
    checkpoint's; train.resume_settings names a change)."""
    betas, eps = (cfg.optim.adam_beta1, cfg.optim.adam_beta2), cfg.optim.adam_eps
    for group in optimizer.param_groups:
        if "betas" in group:
            group["betas"] = betas
        if "eps" in group:
            group["eps"] = eps


def _allocate_distributed_optimizer_state(optimizer: MegatronOptimizer) -> None:
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
