"""Megatron-LM's command-line flags, as far as capture-megatron supports them.

Flag names, meanings and defaults follow megatron/training/arguments.py (core_v0.16.1). A flag that
Megatron-LM knows but capture-megatron does not implement is an error that names it — never silently
ignored; so is a flag neither knows. Pure argparse; no torch import.
"""
from __future__ import annotations

import argparse
import difflib
from importlib import resources

from capture_megatron.errors import CaptureError


class FlagParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one-paragraph CaptureErrors (exit 2, no usage dump)."""

    def error(self, message: str):  # noqa: D401 - argparse hook
        raise CaptureError(message)


def megatron_flag_names() -> frozenset[str]:
    """Every --flag Megatron-LM core_v0.16.1's arguments.py defines."""
    text = resources.files("capture_megatron.megatron").joinpath("megatron_flags.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Model architecture flags (ModelShape)."""
    g = p.add_argument_group("model (Megatron flags)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--vocab-size", type=int, help="vocabulary before padding (default: the tokenizer's)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine", "auto"], default="auto",
                   help="auto: Transformer Engine when importable on CUDA, else Megatron's local spec")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Parallel sizes, batch and memory savers (ParallelPlan); unset values are None."""
    g = p.add_argument_group("parallelism and batch (Megatron flags)")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--context-parallel-size", type=int)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    g.add_argument("--pipeline-model-parallel-layout", type=str)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int)
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true", default=None)
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's alias for --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective", "none"],
                   help="none (capture-megatron: also fixes 'no recompute' for the planner), selective, full")
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--recompute-num-layers-per-stage", type=str,
                   help="capture-megatron: full/block recompute count per pipeline stage, e.g. 2,1,0,0")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """Optimizer, schedule, loop length and logging."""
    g = p.add_argument_group("training (Megatron flags)")
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--initial-loss-scale", type=float, default=4294967296.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"])
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--memory-report", default="", help="capture-megatron: write per-rank peaks here")
    g.add_argument("--no-progress", action="store_true", help="capture-megatron: no progress bar")
    g.add_argument("--exit-interval", type=int, default=0)


def add_data_flags(p: argparse.ArgumentParser) -> None:
    """Data source and tokenizer."""
    g = p.add_argument_group("data (Megatron flags)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="+", default=[])
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default="ByteTokenizer")
    g.add_argument("--tokenizer-model", default="")
    g.add_argument("--vocab-file", default="")
    g.add_argument("--merge-file", default="")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--data-cache-path", default="")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """dist_checkpointing save/resume."""
    g = p.add_argument_group("checkpoints (Megatron flags; format torch_dist)")
    g.add_argument("--save", default="")
    g.add_argument("--load", default="")
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist")


def parse_flags(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`; every leftover flag is named in one CaptureError (unsupported vs unknown)."""
    ns, rest = parser.parse_known_args(argv)
    if not rest:
        return ns
    known = megatron_flag_names()
    ours = [a for action in parser._actions for a in action.option_strings]
    unsupported, unknown = [], []
    for token in rest:
        flag = token.split("=", 1)[0]
        if not flag.startswith("-"):
            unknown.append(f"stray value {token!r}")
        elif flag in known:
            unsupported.append(flag)
        else:
            close = difflib.get_close_matches(flag, ours, n=1)
            unknown.append(flag + (f" (did you mean {close[0]}?)" if close else ""))
    parts = []
    if unsupported:
        parts.append("Megatron-LM flags not supported by capture-megatron: " + ", ".join(unsupported))
    if unknown:
        parts.append("unknown arguments: " + ", ".join(unknown))
    raise CaptureError("; ".join(parts) + ". See --help for the supported flags.")
