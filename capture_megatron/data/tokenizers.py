"""Offline tokenizers for Megatron's GPT datasets, named like Megatron-LM's --tokenizer-type values.

Every tokenizer subclasses megatron-core's `MegatronLegacyTokenizer` (megatron/core/datasets/
megatron_tokenizer.py, the base of Megatron-LM's own training tokenizers), so GPTDataset,
MockGPTDataset and the dataset builders use them as they use Megatron-LM's: they read `vocab_size`,
`eod` and (when defined) `pad`. Nothing is ever downloaded; every file is read from disk.

- `ByteTokenizer` (ours, the default): UTF-8 bytes 0..255, EOD 256, vocabulary 257, no files.
- `HuggingFaceTokenizer --tokenizer-model tokenizer.json` (or a folder holding one), via
  `tokenizers`.
- `SentencePieceTokenizer --tokenizer-model x.model` (alias `GPTSentencePieceTokenizer`): ids and
  vocabulary of the model itself, EOD = the model's </s> -- Megatron-LM's GPTSentencePieceTokenizer.
  (Megatron-LM's SentencePieceTokenizer appends BERT/T5 ids such as <CLS>, <MASK> past the model's
  vocabulary; a GPT does not use them.)
- `GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`: byte-level BPE with GPT-2's
  pre-tokenizer, EOD = <|endoftext|>, vocabulary = len(vocab.json), as Megatron-LM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from capture_megatron.data.file_tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
)
from capture_megatron.data.tokenizer_base import ByteTokenizer, MockTokenizer, TokenizerBase
from capture_megatron.errors import CaptureError

__all__ = [
    "TOKENIZER_TYPES",
    "ByteTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "MockTokenizer",
    "SentencePieceTokenizer",
    "TokenizerBase",
    "TokenizerOptions",
    "build_tokenizer",
]

TOKENIZER_TYPES = (
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "GPT2BPETokenizer",
)
"""Accepted --tokenizer-type values."""


@dataclass(frozen=True)
class TokenizerOptions:
    """The tokenizer flags alone (DataOptions carries the same fields for training)."""

    tokenizer_type: str = "ByteTokenizer"
    """One of TOKENIZER_TYPES (--tokenizer-type)."""
    tokenizer_model: str = ""
    """tokenizer.json (HuggingFace) or .model file (SentencePiece) (--tokenizer-model)."""
    vocab_file: str = ""
    """GPT-2 BPE vocab.json (--vocab-file)."""
    merge_file: str = ""
    """GPT-2 BPE merges.txt (--merge-file)."""


class HasTokenizerFlags(Protocol):
    """Anything with the four tokenizer fields: DataOptions or TokenizerOptions."""

    @property
    def tokenizer_type(self) -> str:
        """--tokenizer-type."""

    @property
    def tokenizer_model(self) -> str:
        """--tokenizer-model."""

    @property
    def vocab_file(self) -> str:
        """--vocab-file."""

    @property
    def merge_file(self) -> str:
        """--merge-file."""


def build_tokenizer(opts: HasTokenizerFlags) -> TokenizerBase:
    """The tokenizer that `opts` (DataOptions or TokenizerOptions) names; CaptureError on bad
    input."""
    kind = opts.tokenizer_type
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(
            _flag(opts.tokenizer_model, kind, "--tokenizer-model path/to/tokenizer.json")
        )
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(
            _flag(opts.tokenizer_model, kind, "--tokenizer-model path/to/x.model")
        )
    if kind == "GPT2BPETokenizer":
        _flag(opts.vocab_file, kind, "--vocab-file vocab.json --merge-file merges.txt")
        _flag(opts.merge_file, kind, "--vocab-file vocab.json --merge-file merges.txt")
        return GPT2BPETokenizer(opts.vocab_file, opts.merge_file)
    raise CaptureError(
        f"--tokenizer-type {kind!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}"
    )


def _flag(value: str, kind: str, needed: str) -> str:
    """`value` when set, else a CaptureError saying what `kind` needs."""
    if not value:
        raise CaptureError(f"--tokenizer-type {kind} needs {needed}")
    return value
