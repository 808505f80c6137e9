"""What else a resume may change, beyond train.resume's architecture, vocabulary and schedule
rules: every other setting that changes the optimizer or the model is refused or named.

- Precision (--bf16 / --fp16 / fp32): megatron-core's optimizer keeps other state for each (fp32
  main weights beside bf16 / fp16 ones, a grad scaler), and loading another precision's fails deep
  in dist_checkpointing. Refused unless the optimizer is not loaded (--no-load-optim, --finetune):
  then the weights are converted, and that is named.
- Adam's betas and epsilon: the checkpoint's optimizer state carries them in its param groups, and
  loading it brings them back over this run's flags without a word (stock Megatron-LM does). Here
  this run's values are set again after the load (load_checkpoint), and the change is named.
- Named, as they take effect from the next iteration: gradient clipping, the fp16 loss scale (the
  checkpoint's current scale is kept), dropout, norm epsilon, the sequence length and the other
  model settings that keep every weight's shape, the gradient / optimizer-state settings of the
  plan, and the data (a new seed, corpus, split or tokenizer: the samples that follow are not the
  ones the saved run would have seen next).

Checkpoints written before the settings were recorded (`saved_settings`) are compared on what
they hold: precision and the param groups. Pure Python.
"""

from __future__ import annotations

from typing import Any

from capture_megatron.config import ModelShape, TrainConfig
from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.training import DataOptions, OptimOptions
from capture_megatron.errors import CaptureError
from capture_megatron.fields import flagged_fields

SCHEDULE = {"lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "weight_decay"}
"""OptimOptions fields Megatron-LM's scheduler rule covers (megatron.schedule)."""
ADAM = {"adam_beta1", "adam_beta2", "adam_eps"}
"""OptimOptions fields the optimizer's param groups carry (set again after a load)."""
UNCHECKED_SHAPE = {"vocab_size", "make_vocab_size_divisible_by"}
"""ModelShape fields train.resume.check_vocab rules on."""


def saved_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint records for the next resume's comparison (common state keys)."""
    return {
        "optim": cfg.optim.to_json(),
        "data": cfg.data.to_json(),
        "seed": cfg.run.seed,
    }


def _said(value: Any) -> str:
    if value is None:
        return "not given"
    if isinstance(value, bool):
        return "given" if value else "not given"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def field_changes(cls: type, saved: Any, current: Any, skip: set[str]) -> list[str]:
    """'--flag A in the checkpoint, B here' for every flagged field of `cls` that differs
    (fields in `skip` are left to other rules)."""
    out = []
    for field, spec in flagged_fields(cls):
        if field.name in skip:
            continue
        old, new = getattr(saved, field.name), getattr(current, field.name)
        if old != new:
            if isinstance(old, bool) and spec.negate:
                old, new = not old, not new
            out.append(f"{spec.name} {_said(old)} in the checkpoint, {_said(new)} here")
    return out


def saved_adam(common: dict[str, Any]) -> dict[str, float]:
    """Adam's betas and epsilon in the checkpoint's optimizer param groups ({} when absent)."""
    for group in _param_groups(common.get("optimizer")):
        betas, eps = group.get("betas"), group.get("eps")
        if isinstance(betas, (tuple, list)) and len(betas) == 2 and eps is not None:
            return {"adam_beta1": betas[0], "adam_beta2": betas[1], "adam_eps": eps}
    return {}


def _param_groups(optim: Any) -> list[dict]:
    """Every param group of a common optimizer state (one optimizer or a chain)."""
    if not isinstance(optim, dict):
        return []
    groups = optim.get("param_groups")
    if isinstance(groups, list):
        return [g for g in groups if isinstance(g, dict)]
    return [
        g for k in sorted(k for k in optim if isinstance(k, int)) for g in _param_groups(optim[k])
    ]


def adam_changes(common: dict[str, Any], optim: OptimOptions) -> list[str]:
    """Adam hyperparameters this run changes from the checkpoint's param groups."""
    saved = saved_adam(common)
    flags = {"adam_beta1": "--adam-beta1", "adam_beta2": "--adam-beta2", "adam_eps": "--adam-eps"}
    return [
        f"{flags[k]} {saved[k]} in the checkpoint, {getattr(optim, k)} here"
        for k in sorted(saved)
        if float(saved[k]) != float(getattr(optim, k))
    ]


def check_precision(path: str, saved: ModelShape, cfg: TrainConfig, loads_optim: bool) -> str:
    """CaptureError when the precision differs and the optimizer is loaded; else a note ('' when
    the same)."""
    old, new = saved.dtype, cfg.shape.dtype
    if old == new:
        return ""
    if loads_optim:
        raise CaptureError(
            f"--load {path}: the checkpoint was trained in {old} and this run is {new} (--bf16 / "
            "--fp16 / neither): megatron-core's optimizer keeps other state for each precision "
            "(fp32 main weights beside bf16 / fp16 ones, a loss scaler), so the checkpoint's "
            f"cannot be loaded into this one. Resume in {old}, or give --no-load-optim to load "
            f"its weights only (converted to {new}) and start the optimizer afresh."
        )
    return f"the checkpoint's {old} weights are converted to {new}"


def setting_changes(
    common: dict[str, Any],
    saved: tuple[ModelShape, DdpOptions],
    cfg: TrainConfig,
    refused: set[str],
) -> list[str]:
    """Every named change: optimizer settings outside the schedule, model settings that keep
    the weights' shapes (`saved`: the checkpoint's model and gradient settings; `refused`: the
    model fields train.resume refuses to change), the plan's gradient / optimizer-state
    settings, and the data."""
    shape, ddp = saved
    out = field_changes(ModelShape, shape, cfg.shape, refused | UNCHECKED_SHAPE)
    out += field_changes(DdpOptions, ddp, cfg.plan.ddp, set())
    if "optim" in common:
        saved_optim = OptimOptions.from_json(str(common["optim"]))
        skip = SCHEDULE | ADAM | ({"initial_loss_scale"} if cfg.shape.dtype != "fp16" else set())
        out += field_changes(OptimOptions, saved_optim, cfg.optim, skip)
    if "data" in common:
        saved_data = DataOptions.from_json(str(common["data"]))
        out += field_changes(DataOptions, saved_data, cfg.data, {"data_cache_path"})
    if "seed" in common and int(common["seed"]) != cfg.run.seed:
        out.append(f"--seed {common['seed']} in the checkpoint, {cfg.run.seed} here")
    return out
