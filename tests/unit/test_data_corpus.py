"""The standard-library docstring corpus: real text, bounded, deterministic across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from capture_megatron.data.corpus import stdlib_corpus


def test_corpus_is_bounded_real_text_and_deterministic(tmp_path):
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    n_small = stdlib_corpus(str(small), max_bytes=50_000)
    n_big = stdlib_corpus(str(big), max_bytes=200_000)
    data_small, data_big = small.read_bytes(), big.read_bytes()
    assert 45_000 < len(data_small) <= 50_000 and 190_000 < len(data_big) <= 200_000
    assert data_big.startswith(data_small) and n_big > n_small > 20
    docs = [json.loads(line)["text"] for line in data_big.decode("utf-8").splitlines()]
    assert len(docs) == n_big == len(set(docs))
    assert docs[0].startswith("abc\n\nAbstract Base Classes")
    assert all("\n\n" in d and len(d) > 40 for d in docs)
    stdlib_corpus(str(tmp_path / "again.jsonl"), max_bytes=200_000)
    assert (tmp_path / "again.jsonl").read_bytes() == data_big


def test_corpus_is_the_same_in_a_fresh_process(tmp_path):
    import capture_megatron.train.data  # noqa: F401 - torch and megatron-core imported here, not there

    stdlib_corpus(str(tmp_path / "here.jsonl"), max_bytes=150_000)
    code = (
        "import sys; from capture_megatron.data.corpus import stdlib_corpus; "
        "stdlib_corpus(sys.argv[1], max_bytes=150_000)"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "there.jsonl")], check=True, timeout=60
    )
    assert (tmp_path / "there.jsonl").read_bytes() == (tmp_path / "here.jsonl").read_bytes()


def test_corpus_rejects_a_non_positive_budget(tmp_path):
    with pytest.raises(ValueError, match="max_bytes 0 must be positive"):
        stdlib_corpus(str(tmp_path / "x.jsonl"), max_bytes=0)
