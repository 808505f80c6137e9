"""The base of every tokenizer here (megatron-core's MegatronLegacyTokenizer without its deprecation
warning) and the tokenizers that need no files: ByteTokenizer and MockTokenizer."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from capture_megatron.config import versions
from capture_megatron.errors import CaptureError

if versions.current() == versions.V0_16:
    with warnings.catch_warnings():  # megatron-core warns at import that TE / Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
else:  # megatron-core 0.17 removed it; its datasets read only what the tokenizers here define
    from capture_megatron.data.identified import (  # type: ignore[assignment]  # same contract
        IdentifiedTokenizer as MegatronLegacyTokenizer,
    )


@contextmanager
def _quiet_legacy_warning() -> Iterator[None]:
    """megatron-core logs a deprecation warning for every legacy tokenizer; these are deliberate."""
    log = logging.getLogger("megatron.core.datasets.megatron_tokenizer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class TokenizerBase(MegatronLegacyTokenizer):
    """Common constructor: megatron's unique identifiers without its deprecation warning."""

    def __init__(self, *paths: str, **options: Any) -> None:
        with _quiet_legacy_warning():
            super().__init__(*paths, **options)

    # every tokenize() here returns a list of ids: megatron-core annotates an ndarray, but its
    # consumers (GPTDataset, Megatron-LM's tools/preprocess_data.py) take any sequence of ids and
    # Megatron-LM's own tokenizers return lists, hence the `ignore[override]` on each

    @property
    def inv_vocab(self) -> dict:
        """Id -> token text."""
        return {i: t for t, i in self.vocab.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(TokenizerBase):
    """UTF-8 bytes as token ids 0..255 and EOD = 256: vocabulary 257, no files needed."""

    EOD = 256

    def __init__(self) -> None:
        super().__init__()

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]  # ids as a list: see TokenizerBase
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
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


class MockTokenizer(TokenizerBase):
    """Ids 0..vocab_size-1 with EOD the last: what --mock-data draws when the model's vocabulary
    is given (the role of Megatron-LM's NullTokenizer). It cannot tokenize text."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise CaptureError(
                f"mock vocabulary {vocab_size} is too small; give --vocab-size 2 or more"
            )
        super().__init__(vocab_size=vocab_size)
        self._size = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]  # ids as a list: see TokenizerBase
        """Not available: mock data is generated, never tokenized."""
        raise CaptureError("MockTokenizer cannot tokenize text; pick a real --tokenizer-type")

    def detokenize(self, ids: Iterable[int]) -> str:
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
