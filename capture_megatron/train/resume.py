"""What a resume may change, checked against the checkpoint before any state is loaded.

Run twice: by `capture-megatron train` before torchrun starts (checkpoint.claim.preflight, so a
refused resume is one paragraph and exit code 2), and by every rank in checkpoint.load_checkpoint
(for runs started with torchrun directly). Everything else a resume changes is refused or named by
train.resume_settings. Pure Python: the callers read the checkpoint.

- The vocabulary. Megatron pads it to a multiple of --make-vocab-size-divisible-by x TP, and the
  padding rows of the output layer take part in the softmax like any other (megatron-core neither
  masks nor drops their logits; GPTModel's output layer has no bias). megatron-core loads the word
  embeddings and output layer with allow_shape_mismatch: rows a larger padding adds are zero (logit
  0, so they take probability mass) and rows a smaller one drops took mass too; either way the
  loaded model computes another function. No value of a new row gives it zero probability, so the
  outputs are preserved exactly only when the padded sizes are equal: a resume under another
  padded size is refused, naming both sizes and the --make-vocab-size-divisible-by that makes them
  equal. A different true vocabulary (another tokenizer) is refused too.
- The learning-rate schedule: Megatron-LM's rule (capture_megatron.megatron.schedule).
- The distributed optimizer: megatron-core cannot convert optimizer state between the two layouts.
- The architecture (check_architecture): every setting that decides which weights exist or what
  they compute must equal the checkpoint's -- the sizes (layers, hidden, heads, query groups, head
  width, MLP width, learned position table), and what keeps every tensor's shape but changes the
  function (heads of another width, LayerNorm vs RMSNorm, biases, the position embedding, the
  activation, tied output weights, rotary settings, window, query/key norms). Megatron-LM's
  check_checkpoint_args (core_v0.16.1) asserts num_layers, hidden_size, num_attention_heads and
  add_position_embedding; the others fail its strict load by missing / unexpected keys. Here all
  are refused before launch, each named by its flag with both values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capture_megatron.config import ModelShape, ParallelPlan, TrainConfig
from capture_megatron.config.training import CheckpointOptions
from capture_megatron.errors import CaptureError
from capture_megatron.fields import flagged_fields
from capture_megatron.megatron import schedule as sched


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint's common state says about the run that saved it."""

    path: str
    """The checkpoint directory (iter_NNNNNNN)."""
    shape: ModelShape
    """The saved model's shape (its true, unpadded vocabulary included)."""
    plan: ParallelPlan
    """The saved run's parallel plan."""
    vocab_size: int
    """The true vocabulary (tokenizer's or --vocab-size), before Megatron's padding."""
    padded_vocab_size: int
    """Rows of the saved word embeddings and output layer."""

    @classmethod
    def from_common(cls, path: str, common: dict[str, Any]) -> SavedRun:
        """From dist_checkpointing.load_common_state_dict(path); checkpoints written before the
        vocabulary was recorded explicitly derive it from the saved shape and TP."""
        shape = ModelShape.from_json(common["shape"])
        plan = ParallelPlan.from_json(common["plan"])
        return cls(
            path=path,
            shape=shape,
            plan=plan,
            vocab_size=int(common.get("vocab_size", shape.vocab_size)),
            padded_vocab_size=int(common.get("padded_vocab_size", shape.padded_vocab(plan.tp))),
        )


def loads_optimizer(opts: CheckpointOptions) -> bool:
    """Whether a resume loads optimizer and scheduler state (Megatron-LM: not with
    --no-load-optim or --finetune)."""
    return not (opts.no_load_optim or opts.finetune)


def divisor_for(vocab: int, padded: int, tp: int, multiple: int = 0) -> int | None:
    """A --make-vocab-size-divisible-by that pads `vocab` to `padded` rows at `tp`: the one that
    keeps the saved run's `multiple` (divisor x TP) when TP divides it, else the smallest (None:
    none does, `padded` is not a multiple of `tp`)."""
    if padded % tp or padded < vocab:
        return None
    candidates = ([multiple] if multiple % tp == 0 else []) + list(range(tp, padded + 1, tp))
    for m in candidates:
        if m and padded % m == 0 and padded - m < vocab:
            return m // tp
    return None


def _vocab_fix(saved: SavedRun, tp: int) -> str:
    multiple = saved.shape.make_vocab_size_divisible_by * saved.plan.tp
    divisor = divisor_for(saved.vocab_size, saved.padded_vocab_size, tp, multiple)
    if divisor is None:
        return (
            f"No --make-vocab-size-divisible-by pads it to {saved.padded_vocab_size} rows at TP "
            f"{tp} ({saved.padded_vocab_size} is not a multiple of {tp}): resume at TP "
            f"{saved.plan.tp} or another TP that divides {saved.padded_vocab_size}."
        )
    return (
        f"Give --make-vocab-size-divisible-by {divisor} to pad it to {saved.padded_vocab_size} "
        f"rows at TP {tp} too (or resume at TP {saved.plan.tp})."
    )


def check_vocab(saved: SavedRun, shape: ModelShape, tp: int) -> None:
    """CaptureError unless this run has the checkpoint's true vocabulary and padded size."""
    if shape.vocab_size != saved.vocab_size:
        raise CaptureError(
            f"--load {saved.path}: the checkpoint was trained on a vocabulary of "
            f"{saved.vocab_size} tokens and this run's has {shape.vocab_size} (another tokenizer "
            "or --vocab-size), so its embedding rows would stand for other tokens. Resume with "
            f"the checkpoint's tokenizer (or --vocab-size {saved.vocab_size})."
        )
    padded = shape.padded_vocab(tp)
    if padded == saved.padded_vocab_size:
        return
    raise CaptureError(
        f"--load {saved.path}: the checkpoint pads its vocabulary of {saved.vocab_size} tokens "
        f"to {saved.padded_vocab_size} rows (--make-vocab-size-divisible-by "
        f"{saved.shape.make_vocab_size_divisible_by} x TP {saved.plan.tp}) and this run would "
        f"pad it to {padded} rows (--make-vocab-size-divisible-by "
        f"{shape.make_vocab_size_divisible_by} x TP {tp}). Every padding row takes part in "
        "Megatron's softmax, so loading into another padded size changes the model's outputs "
        "(stock Megatron-LM refuses the shape mismatch too). " + _vocab_fix(saved, tp)
    )


def _experts(shape: ModelShape) -> str:
    """The expert weights a model holds, in words (what must match to load them)."""
    if not shape.moe.enabled:
        return "no experts"
    moe_layers = [i + 1 for i, m in enumerate(shape.moe_layers) if m]
    shared = shape.moe.moe_shared_expert_intermediate_size
    return f"{shape.moe.num_experts} experts of width {shape.moe_ffn} in layers {moe_layers}" + (
        f" and shared experts of width {shared}" if shared else ""
    )


def check_experts(saved: SavedRun, shape: ModelShape) -> None:
    """CaptureError unless this run's MoE layers hold the same expert weights as the
    checkpoint's (EP and ETP may differ: the experts reshard)."""
    if _experts(saved.shape) == _experts(shape):
        return
    raise CaptureError(
        f"--load {saved.path}: the checkpoint's model has {_experts(saved.shape)} and this "
        f"run's has {_experts(shape)}; its weights cannot be loaded into this model. Give the "
        "checkpoint's --num-experts, --moe-layer-freq, --moe-ffn-hidden-size and "
        "--moe-shared-expert-intermediate-size."
    )


ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "max_position_embeddings",
    "swiglu",
    "geglu",
    "normalization",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "add_bias_linear",
    "add_qkv_bias",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "window_size",
    "qk_layernorm",
    "qk_l2_norm",
    "mtp_num_layers",
)
"""ModelShape fields a resume must keep (their flags are named in the refusal)."""
_EFFECTIVE = {
    "num_query_groups": lambda s: s.groups,
    "kv_channels": lambda s: s.head_dim,
    "ffn_hidden_size": lambda s: s.ffn,
    # only a learned position table has a size; rope computes positions
    "max_position_embeddings": lambda s: (
        s.max_positions if s.position_embedding_type == "learned_absolute" else None
    ),
    "rotary_base": lambda s: s.rotary_base if s.position_embedding_type == "rope" else None,
    "rope_scaling_factor": lambda s: s.rope_scaling_factor if s.use_rope_scaling else None,
}
"""Fields compared by their effective value (a default applied, or irrelevant: None)."""


def _said(value: Any, negate: bool) -> str:
    """A field's value as its flag says it."""
    if isinstance(value, bool):
        return "given" if value != negate else "not given"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def architecture_changes(saved: ModelShape, shape: ModelShape) -> list[str]:
    """Each architecture flag whose value differs: '--flag: A in the checkpoint, B here'."""
    out = []
    for field, spec in flagged_fields(ModelShape):
        if field.name not in ARCHITECTURE:
            continue
        get = _EFFECTIVE.get(field.name, lambda s, n=field.name: getattr(s, n))
        old, new = get(saved), get(shape)
        if old != new:
            out.append(
                f"{spec.name} {_said(old, spec.negate)} in the checkpoint, "
                f"{_said(new, spec.negate)} here"
            )
    if saved.mla != shape.mla:
        out.append("multi-latent attention (--multi-latent-attention and its sizes) differs")
    return out


def check_architecture(saved: SavedRun, shape: ModelShape) -> None:
    """CaptureError naming every architecture flag this run changes from the checkpoint's."""
    changes = architecture_changes(saved.shape, shape)
    if not changes:
        return
    raise CaptureError(
        f"--load {saved.path}: this run's model differs from the checkpoint's: "
        + "; ".join(changes)
        + ". Loading its weights into another architecture either fails on missing or "
        "misshapen tensors or silently computes another function (stock Megatron-LM refuses "
        "these too). Resume with the checkpoint's values, or train the new model without --load."
    )


def _check_optimizer_layout(saved: SavedRun, plan: ParallelPlan) -> None:
    if saved.plan.distributed_optimizer == plan.distributed_optimizer:
        return
    raise CaptureError(
        f"--load {saved.path}: the checkpoint was saved "
        f"{'with' if saved.plan.distributed_optimizer else 'without'}"
        " --use-distributed-optimizer and this run is "
        f"{'with' if plan.distributed_optimizer else 'without'}"
        " it; megatron-core cannot convert optimizer state between the two: match the flag, "
        "or load weights only with --no-load-optim"
    )


def check_resume(
    saved: SavedRun, common: dict[str, Any], cfg: TrainConfig, current: sched.Schedule
) -> list[str]:
    """Every rule above and train.resume_settings'; `current` is this run's schedule (the live
    scheduler's on a rank). Returns the notes naming what the resume changes (CaptureError for
    what it refuses)."""
    from capture_megatron.train import resume_settings as settings

    check_architecture(saved, cfg.shape)
    check_vocab(saved, cfg.shape, cfg.plan.tp)
    check_experts(saved, cfg.shape)
    loads = loads_optimizer(cfg.checkpoint)
    changes = [settings.check_precision(saved.path, saved.shape, cfg, loads)]
    changes += settings.setting_changes(
        common, (saved.shape, saved.plan.ddp), cfg, set(ARCHITECTURE)
    )
    if loads:
        _check_optimizer_layout(saved, cfg.plan)
        sched.check_resume(
            common["opt_param_scheduler"],
            saved.plan.global_batch_size,
            current,
            cfg.plan.global_batch_size,
            cfg.checkpoint,
            saved.path,
            int(common["iteration"]),
        )
        changes += [
            f"{c} (this run's, set again after the optimizer state is loaded)"
            for c in settings.adam_changes(common, cfg.optim)
        ]
    changes = [c for c in changes if c]
    if not changes:
        return []
    return [
        f"--load {saved.path}: this run changes what the checkpoint was trained with, from "
        f"iteration {int(common['iteration']) + 1} on: " + "; ".join(changes) + "."
    ]
