"""Training-run settings beyond the model shape and the parallel plan (Megatron flag names in parentheses)."""
from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.errors import require
from capture_megatron.serial import JsonMixin

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@dataclass(frozen=True)
class OptimOptions(JsonMixin):
    """Adam, learning-rate schedule and gradient clipping."""

    lr: float = 1e-4
    """Peak learning rate (--lr)."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate (--min-lr)."""
    lr_decay_style: str = "linear"
    """constant, linear, cosine, inverse-square-root or WSD (--lr-decay-style)."""
    lr_warmup_iters: int = 0
    """Linear warm-up iterations (--lr-warmup-iters)."""
    lr_decay_iters: int = 0
    """Decay horizon in iterations (--lr-decay-iters); 0 means --train-iters."""
    weight_decay: float = 0.01
    """Adam weight decay (--weight-decay)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (--clip-grad); 0 disables."""
    adam_beta1: float = 0.9
    """Adam beta1 (--adam-beta1)."""
    adam_beta2: float = 0.999
    """Adam beta2 (--adam-beta2)."""
    adam_eps: float = 1e-8
    """Adam epsilon (--adam-eps)."""
    initial_loss_scale: float = 4294967296.0
    """fp16 only: starting dynamic loss scale (--initial-loss-scale)."""

    def __post_init__(self) -> None:
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

    mock_data: bool = False
    """Megatron's MockGPTDataset instead of a corpus (--mock-data)."""
    data_path: tuple[str, ...] = ()
    """Indexed-dataset prefixes, optionally weighted: 'w1 p1 w2 p2' (--data-path)."""
    split: str = "969,30,1"
    """Train/valid/test split weights (--split)."""
    tokenizer_type: str = "ByteTokenizer"
    """ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer or GPT2BPETokenizer (--tokenizer-type)."""
    tokenizer_model: str = ""
    """tokenizer.json (HuggingFace) or .model file (SentencePiece) (--tokenizer-model)."""
    vocab_file: str = ""
    """GPT-2 BPE vocab.json (--vocab-file)."""
    merge_file: str = ""
    """GPT-2 BPE merges.txt (--merge-file)."""
    eod_mask_loss: bool = False
    """Mask the loss at end-of-document tokens (--eod-mask-loss)."""
    data_cache_path: str = ""
    """Where GPTDataset writes its index caches (--data-cache-path); default beside the data."""
    mock_vocab_size: int = 0
    """With --mock-data: token ids are drawn below this (set it to --vocab-size, as Megatron-LM's
    NullTokenizer does); 0: the tokenizer's vocabulary (ByteTokenizer: 257). Ignored for real data."""

    def __post_init__(self) -> None:
        p = []
        if self.mock_vocab_size < 0 or self.mock_vocab_size == 1:
            p.append(f"mock vocabulary {self.mock_vocab_size} must be 0 (the tokenizer's) or at least 2")
        if self.mock_data and self.data_path:
            p.append("give either --mock-data or --data-path, not both")
        if not self.mock_data and not self.data_path:
            p.append("no data: give --data-path PREFIX (see `capture-megatron preprocess`) or --mock-data")
        require(p, "data settings")


@dataclass(frozen=True)
class CheckpointOptions(JsonMixin):
    """Saving and resuming with megatron.core.dist_checkpointing."""

    save: str = ""
    """Directory to save checkpoints into (--save)."""
    load: str = ""
    """Directory to resume from (--load); the latest complete checkpoint is used."""
    save_interval: int = 0
    """Save every this many iterations (--save-interval); 0: only at the end when --save is set."""
    no_load_optim: bool = False
    """Load weights only, not optimizer state (--no-load-optim)."""
    no_load_rng: bool = False
    """Do not restore RNG states (--no-load-rng)."""
    finetune: bool = False
    """Load weights only and restart the iteration count at 0 (--finetune)."""
    exit_on_missing_checkpoint: bool = False
    """Fail instead of starting fresh when --load holds no checkpoint (--exit-on-missing-checkpoint)."""

    def __post_init__(self) -> None:
        require([f"--save-interval {self.save_interval} must be >= 0"] if self.save_interval < 0 else [],
                "checkpoint settings")


@dataclass(frozen=True)
class RunOptions(JsonMixin):
    """Loop length, logging and measurement."""

    train_iters: int = 10
    """Optimizer steps to run, counting resumed ones (--train-iters)."""
    log_interval: int = 1
    """Print a log line every this many iterations (--log-interval)."""
    seed: int = 1234
    """Seed of weights, dropout and data order (--seed)."""
    memory_report: str = ""
    """Write the per-rank MemoryReport JSON here (--memory-report)."""
    distributed_backend: str = ""
    """gloo or nccl (--distributed-backend); default nccl on CUDA, gloo otherwise."""
    progress: bool = True
    """Show a progress bar on the console (off with --no-progress)."""
    overlap_grad_reduce: bool = False
    """Overlap DP gradient reduce-scatter/all-reduce with backward (--overlap-grad-reduce)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's param all-gather with forward (--overlap-param-gather)."""
    exit_interval: int = 0
    """Exit (after saving when --save is set) once the iteration is a multiple of this (--exit-interval)."""

    def __post_init__(self) -> None:
        p = []
        if self.train_iters < 1:
            p.append(f"--train-iters {self.train_iters} must be >= 1")
        if self.log_interval < 1:
            p.append(f"--log-interval {self.log_interval} must be >= 1")
        if self.distributed_backend not in ("", "gloo", "nccl"):
            p.append(f"--distributed-backend {self.distributed_backend!r} not gloo or nccl")
        require(p, "run settings")
