"""Tokenizers read from files on disk (never downloaded): HuggingFace tokenizer.json, SentencePiece
.model, GPT-2 BPE vocab.json + merges.txt (see capture_megatron.data.tokenizers)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from capture_megatron.data.tokenizer_base import TokenizerBase
from capture_megatron.errors import CaptureError

EOD_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
    "<|eot_id|>",
)
"""Tokens taken as end-of-document in a HuggingFace tokenizer.json, in order of preference."""


class HuggingFaceTokenizer(TokenizerBase):
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
                raise CaptureError(
                    f"--tokenizer-model folder {path!r} holds no tokenizer.json; "
                    "give the tokenizer.json file of a HuggingFace tokenizer"
                )
            path = inner
        super().__init__(path)
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:  # tokenizers raises plain Exception on bad files
            raise CaptureError(
                f"--tokenizer-model {path!r} is not a readable HuggingFace tokenizer.json "
                f"({str(err).splitlines()[0]}); give a tokenizer.json saved by `tokenizers`"
            ) from None
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._eod = self._find_eod(path)
        pads = [self._vocab[t] for t in ("<pad>", "<|pad|>", "[PAD]") if t in self._vocab]
        self._pad = pads[0] if pads else None

    def _find_eod(self, path: str) -> int:
        names = list(EOD_CANDIDATES)
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config):
            try:
                with open(config, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
            except (OSError, ValueError):
                eos = None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
        for name in names:
            if name in self._vocab:
                return self._vocab[name]
        raise CaptureError(
            f"HuggingFace tokenizer {path!r} has no end-of-document token (looked for "
            f"{', '.join(EOD_CANDIDATES)}); add one of them as a special token"
        )

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]  # ids as a list: see TokenizerBase
        """Token ids of `text`."""
        return self._tok.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of `ids` (special tokens skipped)."""
        return self._tok.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict:
        """Token text -> id, added tokens included."""
        return dict(self._vocab)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return max(
            self._tok.get_vocab_size(with_added_tokens=True),
            max(self._vocab.values(), default=-1) + 1,
        )

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


class SentencePieceTokenizer(TokenizerBase):
    """A SentencePiece .model file: ids and vocabulary of the model, EOD = its </s> (eos) piece."""

    def __init__(self, path: str) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise CaptureError(
                "--tokenizer-type SentencePieceTokenizer needs the sentencepiece package; "
                "install it with `pip install sentencepiece`"
            ) from None
        path = _existing(path, "--tokenizer-model", "a SentencePiece .model file")
        super().__init__(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as err:
            raise CaptureError(
                f"--tokenizer-model {path!r} is not a SentencePiece model ({err}); "
                "give a .model file written by SentencePieceTrainer"
            ) from None
        if self._sp.eos_id() < 0:
            raise CaptureError(
                f"SentencePiece model {path!r} has no eos piece to end documents with; "
                "train it with eos_id >= 0"
            )

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]  # ids as a list: see TokenizerBase
        """Piece ids of `text`."""
        return self._sp.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
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


class GPT2BPETokenizer(TokenizerBase):
    """GPT-2's byte-level BPE from vocab.json + merges.txt (via the `tokenizers` BPE model)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab_file = _existing(vocab_file, "--vocab-file", "GPT-2's vocab.json")
        merge_file = _existing(merge_file, "--merge-file", "GPT-2's merges.txt")
        super().__init__(vocab_file, merge_file)
        try:
            self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as err:  # tokenizers raises plain Exception on bad files
            raise CaptureError(
                f"--vocab-file {vocab_file!r} / --merge-file {merge_file!r} are not a GPT-2 "
                f"BPE pair ({str(err).splitlines()[0]}); give vocab.json and merges.txt"
            ) from None
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._vocab = self._tok.get_vocab()
        if "<|endoftext|>" not in self._vocab:
            raise CaptureError(
                f"--vocab-file {vocab_file!r} has no <|endoftext|> token to end documents "
                "with; use GPT-2's vocab.json or add it"
            )

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]  # ids as a list: see TokenizerBase
        """BPE ids of `text`."""
        return self._tok.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
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
