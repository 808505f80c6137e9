"""Offline tokenizers for Megatron's GPT datasets, named like Megatron-LM's --tokenizer-type values.

Every tokenizer subclasses megatron-core's `MegatronLegacyTokenizer` (megatron/core/datasets/
megatron_tokenizer.py, the base of Megatron-LM's own training tokenizers), so GPTDataset,
MockGPTDataset and the dataset builders use them as they use Megatron-LM's: they read `vocab_size`,
`eod` and (when defined) `pad`. Nothing is ever downloaded; every file is read from disk.

- `ByteTokenizer` (ours, the default): UTF-8 bytes 0..255, EOD 256, vocabulary 257, no files.
- `HuggingFaceTokenizer --tokenizer-model tokenizer.json` (or a folder holding one), via `tokenizers`.
- `SentencePieceTokenizer --tokenizer-model x.model` (alias `GPTSentencePieceTokenizer`): ids and
  vocabulary of the model itself, EOD = the model's </s> -- Megatron-LM's GPTSentencePieceTokenizer.
  (Megatron-LM's SentencePieceTokenizer appends BERT/T5 ids such as <CLS>, <MASK> past the model's
  vocabulary; a GPT does not use them.)
- `GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`: byte-level BPE with GPT-2's
  pre-tokenizer, EOD = <|endoftext|>, vocabulary = len(vocab.json), as Megatron-LM's.
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import warnings

from capture_megatron.errors import CaptureError

with warnings.catch_warnings():  # megatron-core warns at import that TE / Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "GPT2BPETokenizer")
"""Accepted --tokenizer-type values."""

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|eot_id|>")
"""Tokens taken as end-of-document in a HuggingFace tokenizer.json, in order of preference."""


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

    tokenizer_type: str
    tokenizer_model: str
    vocab_file: str
    merge_file: str


@contextmanager
def _quiet_legacy_warning():
    """megatron-core logs a deprecation warning for every legacy tokenizer; these are deliberate."""
    log = logging.getLogger("megatron.core.datasets.megatron_tokenizer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class _Base(MegatronLegacyTokenizer):
    """Common constructor: megatron's unique identifiers without its deprecation warning."""

    def __init__(self, *paths: str, **options) -> None:
        with _quiet_legacy_warning():
            super().__init__(*paths, **options)

    @property
    def inv_vocab(self) -> dict:
        """Id -> token text."""
        return {i: t for t, i in self.vocab.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(_Base):
    """UTF-8 bytes as token ids 0..255 and EOD = 256: vocabulary 257, no files needed."""

    EOD = 256

    def __init__(self) -> None:
        super().__init__()

    def tokenize(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        """Bytes back to text; EOD and other ids >= 256 are dropped, bad UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict:
        """Byte ids as latin-1 characters, plus <|endoftext|> for EOD."""
        table = {bytes([i]).decode("latin-1"): i for i in range(256)}
        table["<|endoftext|>"] = self.EOD
        return table

    @property
    def vocab_size(self) -> int:
        """257."""
        return 257

    @property
    def eod(self) -> int:
        """256."""
        return self.EOD


class MockTokenizer(_Base):
    """Ids 0..vocab_size-1 with EOD the last: what --mock-data draws when the model's vocabulary
    is given (the role of Megatron-LM's NullTokenizer). It cannot tokenize text."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise CaptureError(f"mock vocabulary {vocab_size} is too small; give --vocab-size 2 or more")
        super().__init__(vocab_size=vocab_size)
        self._size = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        """Not available: mock data is generated, never tokenized."""
        raise CaptureError("MockTokenizer cannot tokenize text; pick a real --tokenizer-type")

    def detokenize(self, ids) -> str:
        """Ids as space-separated numbers."""
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> dict:
        """Ids as their decimal strings."""
        return {str(i): i for i in range(self._size)}

    @property
    def vocab_size(self) -> int:
        """The size given."""
        return self._size

    @property
    def eod(self) -> int:
        """The last id."""
        return self._size - 1


class HuggingFaceTokenizer(_Base):
    """A `tokenizers` tokenizer.json read from disk (Tokenizer.from_file; no hub access).

    Encodes like Megatron-LM's HuggingFaceTokenizer (the file's post-processor and special tokens
    apply); vocabulary includes added tokens; EOD is tokenizer_config.json's eos_token beside the
    file when there is one, else the first of EOD_CANDIDATES in the vocabulary."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        path = _existing(path, "--tokenizer-model", "a HuggingFace tokenizer.json (or its folder)")
        if os.path.isdir(path):
            inner = os.path.join(path, "tokenizer.json")
            if not os.path.isfile(inner):
                raise CaptureError(f"--tokenizer-model folder {path!r} holds no tokenizer.json; "
                                   "give the tokenizer.json file of a HuggingFace tokenizer")
            path = inner
        super().__init__(path)
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:  # tokenizers raises plain Exception on bad files
            raise CaptureError(f"--tokenizer-model {path!r} is not a readable HuggingFace tokenizer.json "
                               f"({str(err).splitlines()[0]}); give a tokenizer.json saved by `tokenizers`")
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._eod = self._find_eod(path)
        pads = [self._vocab[t] for t in ("<pad>", "<|pad|>", "[PAD]") if t in self._vocab]
        self._pad = pads[0] if pads else None

    def _find_eod(self, path: str) -> int:
        names = list(EOD_CANDIDATES)
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config):
            try:
                eos = json.load(open(config, encoding="utf-8")).get("eos_token")
            except (OSError, ValueError):
                eos = None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
        for name in names:
            if name in self._vocab:
                return self._vocab[name]
        raise CaptureError(f"HuggingFace tokenizer {path!r} has no end-of-document token (looked for "
                           f"{', '.join(EOD_CANDIDATES)}); add one of them as a special token")

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self._tok.encode(text).ids

    def detokenize(self, ids) -> str:
        """Text of `ids` (special tokens skipped)."""
        return self._tok.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict:
        """Token text -> id, added tokens included."""
        return dict(self._vocab)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return max(self._tok.get_vocab_size(with_added_tokens=True), max(self._vocab.values(), default=-1) + 1)

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self._eod

    @property
    def pad(self) -> int:
        """Padding id, when the vocabulary has <pad>, <|pad|> or [PAD]."""
        if self._pad is None:
            raise NotImplementedError("HuggingFaceTokenizer: no pad token in this vocabulary")
        return self._pad


class SentencePieceTokenizer(_Base):
    """A SentencePiece .model file: ids and vocabulary of the model, EOD = its </s> (eos) piece."""

    def __init__(self, path: str) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise CaptureError("--tokenizer-type SentencePieceTokenizer needs the sentencepiece package; "
                               "install it with `pip install sentencepiece`") from None
        path = _existing(path, "--tokenizer-model", "a SentencePiece .model file")
        super().__init__(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as err:
            raise CaptureError(f"--tokenizer-model {path!r} is not a SentencePiece model ({err}); "
                               "give a .model file written by SentencePieceTrainer")
        if self._sp.eos_id() < 0:
            raise CaptureError(f"SentencePiece model {path!r} has no eos piece to end documents with; "
                               "train it with eos_id >= 0")

    def tokenize(self, text: str) -> list[int]:
        """Piece ids of `text`."""
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        """Text of `ids`."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict:
        """Piece -> id."""
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    @property
    def vocab_size(self) -> int:
        """Number of pieces."""
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        """The eos piece."""
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        """The bos piece (-1 when the model has none)."""
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        """The pad piece, when the model has one."""
        if self._sp.pad_id() < 0:
            raise NotImplementedError("SentencePieceTokenizer: the model has no pad piece")
        return self._sp.pad_id()


class GPT2BPETokenizer(_Base):
    """GPT-2's byte-level BPE from vocab.json + merges.txt (via the `tokenizers` BPE model)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab_file = _existing(vocab_file, "--vocab-file", "GPT-2's vocab.json")
        merge_file = _existing(merge_file, "--merge-file", "GPT-2's merges.txt")
        super().__init__(vocab_file, merge_file)
        try:
            self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as err:  # tokenizers raises plain Exception on bad files
            raise CaptureError(f"--vocab-file {vocab_file!r} / --merge-file {merge_file!r} are not a GPT-2 "
                               f"BPE pair ({str(err).splitlines()[0]}); give vocab.json and merges.txt")
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._vocab = self._tok.get_vocab()
        if "<|endoftext|>" not in self._vocab:
            raise CaptureError(f"--vocab-file {vocab_file!r} has no <|endoftext|> token to end documents "
                               "with; use GPT-2's vocab.json or add it")

    def tokenize(self, text: str) -> list[int]:
        """BPE ids of `text`."""
        return self._tok.encode(text).ids

    def detokenize(self, ids) -> str:
        """Text of `ids`."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict:
        """Token -> id."""
        return dict(self._vocab)

    @property
    def vocab_size(self) -> int:
        """len(vocab.json)."""
        return len(self._vocab)

    @property
    def eod(self) -> int:
        """<|endoftext|>."""
        return self._vocab["<|endoftext|>"]


def _existing(path: str, flag: str, what: str) -> str:
    """`path` when it exists, else a CaptureError naming the flag and what it should point to."""
    if not path:
        raise CaptureError(f"{flag} is missing; give the path to {what}")
    if not os.path.exists(path):
        raise CaptureError(f"{flag} {path!r} does not exist; give the path to {what}")
    return path


def build_tokenizer(opts: HasTokenizerFlags) -> MegatronLegacyTokenizer:
    """The tokenizer that `opts` (DataOptions or TokenizerOptions) names; CaptureError on bad input."""
    kind = opts.tokenizer_type
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_flag(opts.tokenizer_model, kind, "--tokenizer-model path/to/tokenizer.json"))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(_flag(opts.tokenizer_model, kind, "--tokenizer-model path/to/x.model"))
    if kind == "GPT2BPETokenizer":
        _flag(opts.vocab_file, kind, "--vocab-file vocab.json --merge-file merges.txt")
        _flag(opts.merge_file, kind, "--vocab-file vocab.json --merge-file merges.txt")
        return GPT2BPETokenizer(opts.vocab_file, opts.merge_file)
    raise CaptureError(f"--tokenizer-type {kind!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}")


def _flag(value: str, kind: str, needed: str) -> str:
    """`value` when set, else a CaptureError saying what `kind` needs."""
    if not value:
        raise CaptureError(f"--tokenizer-type {kind} needs {needed}")
    return value
