"""megatron-core's dataset index caches run no code and are what was written (train.data_cache,
issue 56 problem 1): a pickle put in place of an index cache is never unpickled, a truncated,
altered or object-holding cache is set aside (named) and built again, and the rebuilt dataset
yields the samples the first build yielded. Real GPTDataset / BlendedDataset builds of a small
byte-tokenized corpus, in-process (no torch.distributed: this process writes the caches)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy
import pytest
import torch

from capture_megatron.config.training import DataOptions
from capture_megatron.data.corpus import stdlib_corpus
from capture_megatron.data.preprocess import preprocess
from capture_megatron.data.tokenizers import TokenizerOptions
from capture_megatron.train import data as td

SEQ, SAMPLES, SEED = 32, 16, 1234


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("cached-data")
    stdlib_corpus(str(root / "corpus.jsonl"), max_bytes=20_000)
    return preprocess(
        str(root / "corpus.jsonl"), str(root / "corpus"), TokenizerOptions(), append_eod=True
    ).prefixes[0]


class _RunsCode:
    """Unpickling this runs a shell command (what a crafted cache would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _build(opts: DataOptions) -> list[torch.Tensor]:
    dataset = td.build_train_dataset(opts, SEQ, SAMPLES, SEED)
    return [torch.as_tensor(dataset[i]["tokens"]) for i in range(SAMPLES)]


def _caches(cache: Path, kind: str) -> list[Path]:
    return sorted(cache.rglob(f"*-{kind}.npy"))


def _fresh(tmp_path: Path, prefix: str) -> tuple[DataOptions, list[torch.Tensor], Path]:
    cache = tmp_path / "cache"
    opts = DataOptions(data_path=(prefix,), data_cache_path=str(cache))
    return opts, _build(opts), cache


@pytest.mark.parametrize("kind", ["document_index", "sample_index", "shuffle_index"])
def test_a_pickled_index_cache_runs_no_code(tmp_path, prefix, kind, capsys):
    opts, first, cache = _fresh(tmp_path, prefix)
    marker = tmp_path / "pwned"
    (target,) = _caches(cache, kind)
    target.write_bytes(pickle.dumps(_RunsCode(str(marker))))
    again = _build(opts)
    assert not marker.exists(), "unpickling the cache ran its code"
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    note = capsys.readouterr().out
    assert f"dataset index cache {target}: it is not an .npy file" in note
    assert f"Set aside as {target.name}.damaged; building it again" in note
    assert (target.parent / (target.name + ".damaged")).exists()


def test_a_truncated_or_altered_cache_is_built_again(tmp_path, prefix, capsys):
    opts, first, cache = _fresh(tmp_path, prefix)
    (shuffle,) = _caches(cache, "shuffle_index")
    shuffle.write_bytes(shuffle.read_bytes()[:-8])  # a kill during numpy.save
    assert all(torch.equal(a, b) for a, b in zip(first, _build(opts), strict=True))
    assert "header promises" in capsys.readouterr().out
    (sample,) = _caches(cache, "sample_index")
    values = numpy.load(sample)
    values[1, 0] += 1  # same size, other numbers: only the checksum tells
    numpy.save(sample, values)
    assert all(torch.equal(a, b) for a, b in zip(first, _build(opts), strict=True))
    assert "does not match the SHA-256 recorded when it was written" in capsys.readouterr().out


def test_an_index_of_python_objects_is_never_unpickled(tmp_path, prefix, capsys):
    opts, first, cache = _fresh(tmp_path, prefix)
    marker = tmp_path / "pwned"
    (doc,) = _caches(cache, "document_index")
    numpy.save(doc, numpy.array([_RunsCode(str(marker))], dtype=object), allow_pickle=True)
    assert all(torch.equal(a, b) for a, b in zip(first, _build(opts), strict=True))
    assert not marker.exists()
    assert "it holds Python objects" in capsys.readouterr().out


def test_a_cache_without_checksums_is_used_when_sound(tmp_path, prefix, capsys):
    # written by stock Megatron-LM: no <file>.sha256
    opts, first, cache = _fresh(tmp_path, prefix)
    for sums in cache.rglob("*.sha256"):
        sums.unlink()
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*.npy")}
    assert all(torch.equal(a, b) for a, b in zip(first, _build(opts), strict=True))
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.npy")} == before
    assert "dataset index cache" not in capsys.readouterr().out


def test_the_blend_caches_run_no_code_either(tmp_path, prefix):
    cache = tmp_path / "cache"
    opts = DataOptions(data_path=("0.5", prefix, "0.5", prefix), data_cache_path=str(cache))
    first = _build(opts)
    marker = tmp_path / "pwned"
    blend = [p for p in cache.rglob("*.npy") if "Blended" in p.name]
    assert blend, sorted(p.name for p in cache.rglob("*"))
    for path in blend:
        path.write_bytes(pickle.dumps(_RunsCode(str(marker))))
    assert all(torch.equal(a, b) for a, b in zip(first, _build(opts), strict=True))
    assert not marker.exists()


def test_a_reader_refuses_a_pickle_in_one_paragraph(tmp_path):
    from capture_megatron.errors import CaptureError
    from capture_megatron.train import data_cache

    path = tmp_path / "x-document_index.npy"
    path.write_bytes(pickle.dumps(_RunsCode(str(tmp_path / "pwned"))))
    with pytest.raises(CaptureError, match=f"dataset index cache {path} is not an .npy"):
        data_cache.SafeNumpy().load(str(path), allow_pickle=True, mmap_mode="r")
    assert not (tmp_path / "pwned").exists()
