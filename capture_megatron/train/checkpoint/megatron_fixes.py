"""Three megatron-core 0.16.1 checkpoint defects: two in the DistributedOptimizer's
'fully_reshardable' checkpoints, one in what a killed save leaves running.

Fixes 1 and 2 are installed by ``apply()`` before a checkpoint is saved or loaded, fix 3 by
``writers_die_with_rank()`` before one is saved; nothing in site-packages is edited, and each
replacement is megatron's own logic minus the defect.

1. Bucket padding (any machine). ``get_parameter_state_dp_zero`` concatenates the DP-gathered
   buckets *without* the padding between them ("gets rid of the padding between buckets"), but
   ``sharded_param_state_fully_reshardable`` then slices that tensor with
   ``buffer.param_index_map`` offsets, which *include* it. With more than one bucket (tied
   embeddings under PP give the shared embedding its own bucket; --overlap-grad-reduce makes
   buckets) every later parameter's optimizer state is read shifted — megatron logs "param range
   exceeds unpadded buffer ... data corruption" (its issue #504). Measured here: PP2, tied
   embeddings, fp32: the saved main copy of the word embeddings was shifted by 64 elements, and a
   resumed run diverged from an uninterrupted one. The fix re-inserts the padding so each bucket's
   data sits at its ``bucket.offset``, only for the fully_reshardable path.
2. 'step' without Apex/TE. torch.optim.Adam keeps a per-parameter 'step' in its state;
   ``_set_main_param_and_optimizer_states`` copies every key of the live state from the loaded
   tensors, which deliberately exclude 'step' (restored from the param groups) -> KeyError: 'step'.
   The fix copies only the keys the checkpoint carries. In the same path, DistributedOptimizer.
   load_state_dict gives *one* 'step' tensor object to every parameter's state; torch's foreach Adam
   increments steps in place, so after a resume every step advanced by the number of parameters per
   iteration and Adam's bias correction went wrong (measured: a resumed run's loss drifted from an
   uninterrupted one from the second resumed iteration on). ``untie_adam_steps`` gives each
   parameter its own copy after loading.
3. A SIGKILLed rank's save helpers live on. ``FileSystemWriterAsync`` collects its forked writers'
   results through a queue of a multiprocessing Manager that it starts (spawned, once per rank)
   on the first save and never stops. Killed with its rank (torchrun SIGKILLed mid-save), the
   Manager was left running for good, and with it multiprocessing's resource tracker, whose pipe
   it holds (measured: two processes per rank after tests/dist/test_checkpoint.py's kill). The
   fix starts that Manager itself, with an initializer that makes it die with the rank
   (capture_megatron.megatron.lifeline.die_with_parent), and gives megatron its queue; the forked
   writers die with the rank through ``lifeline.forks_die_with_this`` (train/entry.py).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.managers import SyncManager

import torch

from capture_megatron.emulate import patches
from capture_megatron.megatron import lifeline


def _pad_world_tensors(optimizer, state):
    """Rebuild each buffer's world tensors at their padded (param_index_map) positions."""
    if state is None:
        return state
    for gbuf_idx, dtype_state in state.items():
        if not isinstance(gbuf_idx, int):
            continue
        buffer = optimizer.buffers[gbuf_idx]
        for world in dtype_state.values():
            for key in ("param", "exp_avg", "exp_avg_sq"):
                flat = world[key]
                padded = torch.zeros((buffer.numel,), dtype=flat.dtype, device=flat.device)
                src = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    padded[bucket.offset : bucket.offset + n].copy_(flat[src : src + n])
                    src += n
                world[key] = padded
            world["numel_unpadded"] = buffer.numel
    return state


def _set_main_param_and_optimizer_states(self, model_param, tensors):
    """Copy the loaded keys into the main param and its Adam state; leave 'step' as restored."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    for key, dst in {"param": main_param, **self.optimizer.state[main_param]}.items():
        if key in tensors:
            dst.copy_(tensors[key])


def untie_adam_steps(optimizer) -> None:
    """After loading: give every Adam parameter state its own 'step' tensor (see fix 2)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, dopt.DistributedOptimizer) and not dopt.HAVE_APEX_OR_TE:
            for state in opt.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()


def apply() -> None:
    """Install both fixes (idempotent). Fix 2 only when megatron runs without Apex/TE."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if not patches.first("ckpt_fixes"):
        return
    cls = dopt.DistributedOptimizer
    original_fully = cls.sharded_param_state_fully_reshardable
    original_dp_zero = cls.get_parameter_state_dp_zero

    def fully_reshardable(self, *args, **kwargs):
        self.get_parameter_state_dp_zero = lambda *a, **k: _pad_world_tensors(
            self, original_dp_zero(self, *a, **k)
        )
        try:
            return original_fully(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero

    why = "fix 1: fully-reshardable optimizer state with padded world tensors"
    patches.patch(cls, "sharded_param_state_fully_reshardable", fully_reshardable, why)
    if not dopt.HAVE_APEX_OR_TE:
        original_set = cls._set_main_param_and_optimizer_states

        from capture_megatron.megatron.training import states_in_own_dtypes

        def set_states(self, model_param, tensors):
            if states_in_own_dtypes(self.config):
                return original_set(self, model_param, tensors)
            return _set_main_param_and_optimizer_states(self, model_param, tensors)

        why = "fix 2: main params and optimizer states set without Apex / TE"
        patches.patch(cls, "_set_main_param_and_optimizer_states", set_states, why)


def writers_die_with_rank() -> None:
    """Fix 3: megatron-core's checkpoint-writer results queue, held by a Manager that dies with
    this rank (idempotent; nothing done once megatron started its own)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if fsa._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # as megatron's own
    manager.start(initializer=lifeline.die_with_parent, initargs=(os.getpid(),))
    why = "fix 3: the writers' results Manager dies with its rank"
    patches.patch(fsa, "_results_queue", manager.Queue(), why)  # the queue keeps its manager
