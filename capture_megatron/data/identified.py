"""The base of this package's tokenizers on megatron-core 0.17 and newer, which removed
megatron.core.datasets.megatron_tokenizer.MegatronLegacyTokenizer (0.16.1's base of Megatron-LM's
training tokenizers).

What megatron-core's datasets and Megatron-LM's tools/preprocess_data.py read of a tokenizer is
duck-typed (GPTDataset: vocab_size, eod, pad, unique_identifiers via the dataset's own
identifiers): this class keeps 0.16.1's constructor and identifiers, so that a dataset built on
either version has the same cache key and the same samples.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any


class IdentifiedTokenizer(ABC):
    """megatron-core 0.16.1's MegatronLegacyTokenizer contract: unique identifiers from the
    tokenizer's paths and options, abstract tokenize / vocab / inv_vocab / vocab_size."""

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option in tokenizer_options:
            self.unique_identifiers[option] = str(tokenizer_options[option])
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        super().__init__()

    @abstractmethod
    def tokenize(self, text: str) -> Any:
        """The ids of `text`."""

    def detokenize(self, ids: Any) -> str:
        """The text of `ids` (optional)."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    @property
    @abstractmethod
    def vocab(self) -> Any:
        """Token -> id."""

    @property
    @abstractmethod
    def inv_vocab(self) -> Any:
        """Id -> token."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The number of ids."""

    @property
    def eod(self) -> int:
        """The end-of-document id (optional)."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'eod'")

    @property
    def pad(self) -> int:
        """The padding id (optional)."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'pad'")
