"""The learning-rate schedule of a run as megatron-core's OptimizerParamScheduler holds it, and
Megatron-LM's rule for resuming it. Pure Python (no torch).

The scheduler saves these values in a checkpoint (its state_dict) and, when it loads them, checks
each against the current run's: they must be equal unless --override-opt_param-scheduler (take the
run's) or --use-checkpoint-opt_param-scheduler (take the checkpoint's) is given
(megatron/core/optimizer_param_scheduler.py, core_v0.16.1). Megatron-LM asserts; here the
difference is one CaptureError naming every differing value and both flags, raised before any
state is loaded. Steps count samples (iterations x global batch), as in Megatron-LM."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from capture_megatron.config.training import CheckpointOptions, OptimOptions
from capture_megatron.errors import CaptureError

OVERRIDE = "--override-opt_param-scheduler"
"""Megatron-LM's flag: resume with this run's schedule."""
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"
"""Megatron-LM's flag: resume with the checkpoint's schedule."""


@dataclass(frozen=True)
class Schedule:
    """The values OptimizerParamScheduler.state_dict() saves and load_state_dict() checks."""

    max_lr: float
    """Peak learning rate (--lr)."""
    min_lr: float
    """Floor of the decayed learning rate (--min-lr)."""
    lr_warmup_steps: int
    """Warm-up, in samples (--lr-warmup-iters x global batch)."""
    lr_decay_steps: int
    """Decay horizon, in samples ((--lr-decay-iters or --train-iters) x global batch)."""
    lr_decay_style: str
    """--lr-decay-style."""
    start_wd: float
    """Weight decay at the start (--weight-decay)."""
    end_wd: float
    """Weight decay at the end (--weight-decay)."""
    wd_incr_steps: int
    """Weight-decay horizon, in samples (the decay horizon)."""
    wd_incr_style: str
    """How weight decay moves from start_wd to end_wd ('constant' here)."""

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Schedule:
        """The schedule saved in a checkpoint (OptimizerParamScheduler.state_dict())."""
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls)})


LABELS = {
    "max_lr": "peak learning rate (--lr)",
    "min_lr": "minimum learning rate (--min-lr)",
    "lr_warmup_steps": "warm-up (--lr-warmup-iters)",
    "lr_decay_steps": "decay horizon (--lr-decay-iters, default --train-iters)",
    "lr_decay_style": "decay style (--lr-decay-style)",
    "start_wd": "weight decay (--weight-decay)",
    "end_wd": "end weight decay (--weight-decay)",
    "wd_incr_steps": "weight-decay horizon (the decay horizon)",
    "wd_incr_style": "weight-decay increment style",
}
"""How each Schedule value is named in messages, with the flag that sets it."""


def schedule(optim: OptimOptions, train_iters: int, global_batch_size: int) -> Schedule:
    """The schedule a run with these flags builds (capture_megatron.megatron.training)."""
    decay = (optim.lr_decay_iters or train_iters) * global_batch_size
    return Schedule(
        max_lr=float(optim.lr),
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_iters * global_batch_size,
        lr_decay_steps=decay,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )


def _shown(name: str, value: Any, global_batch_size: int) -> str:
    if name.endswith("_steps") and global_batch_size and value % global_batch_size == 0:
        return f"{value // global_batch_size} iterations ({value} samples)"
    return f"{value} samples" if name.endswith("_steps") else str(value)


FOLLOWS = {"end_wd": "start_wd", "wd_incr_steps": "lr_decay_steps"}
"""Values set from the same flag as another: not named again when they differ alike."""


def differences(saved: Schedule, saved_gbs: int, current: Schedule, gbs: int) -> list[str]:
    """One phrase per value that differs: '<what> <checkpoint's> in the checkpoint, <run's>
    here'."""
    out = []
    for field in dataclasses.fields(Schedule):
        old, new = getattr(saved, field.name), getattr(current, field.name)
        leader = FOLLOWS.get(field.name)
        if leader and (old, new) == (getattr(saved, leader), getattr(current, leader)):
            continue
        if old != new:
            out.append(
                f"{LABELS[field.name]} {_shown(field.name, old, saved_gbs)} in the checkpoint, "
                f"{_shown(field.name, new, gbs)} here"
            )
    return out


def _exhausted(saved: Schedule, num_steps: int) -> str:
    """A note when the checkpoint's schedule has already decayed to its floor."""
    decayed = num_steps > saved.lr_decay_steps or (
        num_steps == saved.lr_decay_steps and saved.lr_decay_style != "inverse-square-root"
    )
    if saved.lr_decay_style == "constant" or not decayed:
        return ""
    return (
        f" (the checkpoint's schedule has already decayed: every further iteration would train "
        f"at its minimum learning rate {saved.min_lr})"
    )


def check_resume(
    state: dict[str, Any],
    saved_gbs: int,
    current: Schedule,
    gbs: int,
    opts: CheckpointOptions,
    where: str,
    iteration: int,
) -> None:
    """Megatron-LM's rule: CaptureError when the checkpoint's schedule (`state`, the saved
    state_dict, of iteration `iteration` in checkpoint `where`) differs from this run's and neither
    flag says which one to follow."""
    if opts.override_opt_param_scheduler or opts.use_checkpoint_opt_param_scheduler:
        return
    saved = Schedule.from_state(state)
    diff = differences(saved, saved_gbs, current, gbs)
    if not diff:
        return
    raise CaptureError(
        f"--load {where}: this run's learning-rate schedule differs from the checkpoint's: "
        + "; ".join(diff)
        + ". Megatron-LM refuses to pick one silently, and so does capture-megatron: give "
        f"{OVERRIDE} to follow this run's flags from iteration {iteration + 1} on, or "
        f"{USE_CHECKPOINT} to keep the checkpoint's schedule"
        + _exhausted(saved, int(state["num_steps"]))
        + "."
    )
