"""Fixtures for the distributed tests: a real corpus turned into Megatron's indexed dataset."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory) -> str:
    """Python standard-library docstrings, byte-tokenized into
    <dir>/corpus_text_document.{bin,idx}."""
    from harness import cli

    from capture_megatron.data.corpus import stdlib_corpus

    root = tmp_path_factory.mktemp("corpus")
    jsonl = os.path.join(root, "corpus.jsonl")
    stdlib_corpus(jsonl, max_bytes=400_000)
    prefix = os.path.join(root, "corpus")
    done = cli(
        [
            "preprocess",
            "--input",
            jsonl,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "ByteTokenizer",
            "--append-eod",
        ]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return prefix + "_text_document"
