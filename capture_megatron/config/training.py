"""Training-run settings beyond the model shape and the parallel plan, each field with its Megatron
flag (capture_megatron.fields), and TrainConfig: everything one training run needs.

Pure Python: no torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config.kernels import Kernels
from capture_megatron.config.model import ModelShape
from capture_megatron.config.parallel import ParallelPlan
from capture_megatron.errors import CaptureError, require
from capture_megatron.fields import flag, value_problems
from capture_megatron.serial import JsonMixin

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""Megatron's --lr-decay-style choices."""
CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
"""Megatron-LM's --ckpt-format choices (the format does not change training memory)."""
EXIT_SIGNALS = (
    "SIGTERM",
    "SIGINT",
    "SIGHUP",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGALRM",
    "SIGXCPU",
)
"""--exit-signal choices, by name (Megatron-LM's spelling): the signals that ask a job to stop
(Slurm's --signal, preemption, time limits)."""


@dataclass(frozen=True)
class OptimOptions(JsonMixin):
    """Adam, learning-rate schedule and gradient clipping (the optimizer's kind is the plan's:
    capture_megatron.features.optimizers)."""

    lr: float = flag("--lr", 1e-4)
    """Peak learning rate."""
    min_lr: float = flag("--min-lr", 0.0)
    """Floor of the decayed learning rate."""
    lr_decay_style: str = flag("--lr-decay-style", "linear", choices=LR_DECAY_STYLES)
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_warmup_iters: int = flag("--lr-warmup-iters", 0)
    """Linear warm-up iterations."""
    lr_decay_iters: int = flag("--lr-decay-iters", 0)
    """Decay horizon in iterations (--lr-decay-iters); 0 means --train-iters."""
    weight_decay: float = flag("--weight-decay", 0.01)
    """Adam weight decay."""
    clip_grad: float = flag("--clip-grad", 1.0)
    """Global gradient-norm clip (--clip-grad); 0 disables."""
    adam_beta1: float = flag("--adam-beta1", 0.9)
    """Adam beta1."""
    adam_beta2: float = flag("--adam-beta2", 0.999)
    """Adam beta2."""
    adam_eps: float = flag("--adam-eps", 1e-8)
    """Adam epsilon."""
    initial_loss_scale: float = flag("--initial-loss-scale", 4294967296.0)
    """fp16 only: starting dynamic loss scale."""

    def __post_init__(self) -> None:
        require(value_problems(self), "flags")  # types, finite, not negative, >= 1
        p = []
        if self.lr <= 0:
            p.append(f"--lr {self.lr} must be positive")
        if not 0 <= self.min_lr <= self.lr:
            p.append(f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            p.append(f"--lr-decay-style {self.lr_decay_style!r} not one of {LR_DECAY_STYLES}")
        if self.lr_warmup_iters < 0 or self.lr_decay_iters < 0:
            p.append("--lr-warmup-iters / --lr-decay-iters must be >= 0")
        if self.clip_grad < 0:
            p.append(f"--clip-grad {self.clip_grad} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                p.append(f"--{name.replace('_', '-')} {getattr(self, name)} not in [0, 1)")
        require(p, "optimizer settings")


@dataclass(frozen=True)
class DataOptions(JsonMixin):
    """Where training sequences come from."""

    mock_data: bool = flag("--mock-data", False)
    """Megatron's MockGPTDataset instead of a corpus."""
    data_path: tuple[str, ...] = flag("--data-path", ())
    """Indexed-dataset prefixes, optionally weighted: 'w1 p1 w2 p2'."""
    split: str = flag("--split", "969,30,1")
    """Train/valid/test split weights."""
    tokenizer_type: str = flag("--tokenizer-type", "ByteTokenizer")
    """ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer or GPT2BPETokenizer."""
    tokenizer_model: str = flag("--tokenizer-model", "")
    """tokenizer.json (HuggingFace) or .model file (SentencePiece)."""
    vocab_file: str = flag("--vocab-file", "")
    """GPT-2 BPE vocab.json."""
    merge_file: str = flag("--merge-file", "")
    """GPT-2 BPE merges.txt."""
    eod_mask_loss: bool = flag("--eod-mask-loss", False)
    """Mask the loss at end-of-document tokens."""
    data_cache_path: str = flag("--data-cache-path", "")
    """Where GPTDataset writes its index caches (--data-cache-path); default beside the data."""
    mock_vocab_size: int = 0
    """With --mock-data: token ids are drawn below this (set it to --vocab-size, as Megatron-LM's
    NullTokenizer does); 0: the tokenizer's vocabulary (ByteTokenizer: 257). Ignored for real
    data."""

    def __post_init__(self) -> None:
        require(value_problems(self), "flags")  # types, finite, not negative, >= 1
        p = []
        if self.mock_vocab_size < 0 or self.mock_vocab_size == 1:
            p.append(
                f"mock vocabulary {self.mock_vocab_size} must be 0 (the tokenizer's) or at least 2"
            )
        if self.mock_data and self.data_path:
            p.append("give either --mock-data or --data-path, not both")
        if not self.mock_data and not self.data_path:
            p.append(
                "no data: give --data-path PREFIX (see `capture-megatron preprocess`) "
                "or --mock-data"
            )
        require(p, "data settings")


@dataclass(frozen=True)
class CheckpointOptions(JsonMixin):
    """Saving and resuming with megatron.core.dist_checkpointing."""

    save: str = flag("--save", "")
    """Directory to save checkpoints into."""
    load: str = flag("--load", "")
    """Directory to resume from (--load); the latest complete checkpoint is used."""
    ckpt_step: int | None = flag("--ckpt-step", None, omit_default=True)
    """Resume from this iteration's checkpoint in --load instead of the newest (as Megatron-LM,
    without reading the tracker file); refused when it is missing or damaged, and when --save is
    the same directory and holds later checkpoints this run would replace."""
    save_interval: int = flag("--save-interval", 0)
    """Save every this many iterations (--save-interval); 0: only at the end when --save is set."""
    no_load_optim: bool = flag("--no-load-optim", False)
    """Load weights only, not optimizer state."""
    no_load_rng: bool = flag("--no-load-rng", False)
    """Do not restore RNG states."""
    finetune: bool = flag("--finetune", False)
    """Load weights only and restart the iteration count at 0."""
    exit_on_missing_checkpoint: bool = flag("--exit-on-missing-checkpoint", False)
    """Fail instead of starting fresh when --load holds no checkpoint."""
    override_opt_param_scheduler: bool = flag(
        "--override-opt_param-scheduler", False, aliases=("--override-opt-param-scheduler",)
    )
    """On resume, take the learning-rate schedule (--lr, --min-lr, --lr-warmup-iters, the decay
    iterations and style, weight decay) from this run's flags, not from the checkpoint."""
    use_checkpoint_opt_param_scheduler: bool = flag(
        "--use-checkpoint-opt_param-scheduler",
        False,
        aliases=("--use-checkpoint-opt-param-scheduler",),
    )
    """On resume, keep the checkpoint's learning-rate schedule and ignore this run's schedule
    flags. Without either flag a resume whose schedule differs from the checkpoint's is refused,
    as in Megatron-LM."""
    ckpt_format: str = flag("--ckpt-format", "torch_dist", choices=CKPT_FORMATS)
    """Checkpoint format: Megatron-LM's choices are accepted by predict and plan (the format does
    not change training memory); capture-megatron trains with torch_dist
    (megatron.core.dist_checkpointing)."""

    def __post_init__(self) -> None:
        require(value_problems(self), "flags")  # types, finite, not negative, >= 1
        p = []
        if self.save_interval < 0:
            p.append(f"--save-interval {self.save_interval} must be >= 0")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            p.append(
                "--override-opt_param-scheduler (this run's schedule) and "
                "--use-checkpoint-opt_param-scheduler (the checkpoint's) contradict: give one"
            )
        require(p, "checkpoint settings")

    def require_trainable(self) -> None:
        """Refuse, for training, a format capture-megatron cannot save or resume (predict and
        plan accept every Megatron-LM format: it does not change training memory), and
        --ckpt-step without --load (Megatron-LM ignores it there; predict and plan list it)."""
        if self.ckpt_step is not None and not self.load:
            raise CaptureError(
                f"--ckpt-step {self.ckpt_step} names a checkpoint to resume from but no --load "
                "directory was given: add --load DIR, or leave --ckpt-step out"
            )
        if self.ckpt_format != "torch_dist":
            raise CaptureError(
                f"--ckpt-format {self.ckpt_format}: capture-megatron saves and resumes "
                "torch_dist checkpoints (megatron.core.dist_checkpointing) only; train with "
                "--ckpt-format torch_dist (predict and plan accept every format)"
            )


@dataclass(frozen=True)
class RunOptions(JsonMixin):
    """Loop length, logging and measurement."""

    train_iters: int = flag("--train-iters", 10)
    """Optimizer steps to run, counting resumed ones."""
    log_interval: int = flag("--log-interval", 1)
    """Print a log line every this many iterations."""
    seed: int = flag("--seed", 1234)
    """Seed of weights, dropout and data order."""
    memory_report: str = flag("--memory-report", "", note="(capture-megatron)")
    """Write the per-rank MemoryReport JSON here."""
    moe_routing_stats: str = flag("--moe-routing-stats", "", note="(capture-megatron)")
    """Write the MoE routing statistics here: per step and MoE layer, the tokens each expert is
    routed per sequence and the tokens each rank's experts receive (capture_megatron.train.routing;
    JSON, gzip when the name ends in .gz)."""
    distributed_backend: str = flag("--distributed-backend", "", choices=("gloo", "nccl"))
    """gloo or nccl (--distributed-backend); default nccl on CUDA, gloo otherwise."""
    progress: bool = flag("--no-progress", True, negate=True, note="(capture-megatron)")
    """Show a progress bar on the console (off with --no-progress)."""
    overlap_param_gather: bool = flag("--overlap-param-gather", False)
    """Overlap the distributed optimizer's param all-gather with forward."""
    exit_interval: int = flag("--exit-interval", 0)
    """Exit (after saving when --save is set) once the iteration is a multiple of this."""
    exit_signal_handler: bool = flag("--exit-signal-handler", False)
    """On --exit-signal, finish the iteration, save a checkpoint (with --save) and exit (what
    `launch --requeue` relies on)."""
    exit_signal: str = flag("--exit-signal", "SIGTERM", choices=EXIT_SIGNALS)
    """The signal --exit-signal-handler waits for, by name (e.g. SIGUSR1)."""

    def __post_init__(self) -> None:
        require(value_problems(self), "flags")  # types, finite, not negative, >= 1
        p = []
        if self.train_iters < 1:
            p.append(f"--train-iters {self.train_iters} must be >= 1")
        if self.log_interval < 1:
            p.append(f"--log-interval {self.log_interval} must be >= 1")
        if self.distributed_backend not in ("", "gloo", "nccl"):
            p.append(f"--distributed-backend {self.distributed_backend!r} not gloo or nccl")
        require(p, "run settings")


@dataclass(frozen=True)
class BuildOptions(JsonMixin):
    """How the model is built beyond its shape and plan."""

    init_method_std: float = flag("--init-method-std", 0.02)
    """Standard deviation of the normal weight initialisation."""

    def __post_init__(self) -> None:
        require(value_problems(self), "flags")  # positive and finite (config.fields)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs, validated before any process group starts."""

    shape: ModelShape
    """The model."""
    plan: ParallelPlan
    """Parallel sizes, batch, layout, recompute."""
    optim: OptimOptions
    """Adam / LR schedule / clipping."""
    data: DataOptions
    """Data source and tokenizer."""
    checkpoint: CheckpointOptions
    """Save / resume."""
    run: RunOptions
    """Loop length, logging, measurement."""
    build: BuildOptions
    """Model build options (initialisation)."""
    kernels: Kernels = Kernels(transformer_impl="auto")
    """Layer implementation and fused kernels (training: TE when importable on CUDA, else local)."""

    def __post_init__(self) -> None:
        if self.run.moe_routing_stats and not self.shape.moe.enabled:
            raise CaptureError("--moe-routing-stats needs a model with experts (--num-experts)")
        if self.run.moe_routing_stats and self.plan.recompute.granularity == "full":
            raise CaptureError(
                "--moe-routing-stats with --recompute-granularity full: full recompute runs each "
                "router again in the backward pass, which would count its tokens twice; record "
                "routing without full recompute"
            )
        self.checkpoint.require_trainable()
