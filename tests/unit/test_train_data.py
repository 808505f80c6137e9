"""Training iterators: Megatron's GPTDataset / MockGPTDataset with MegatronPretrainingSampler
order."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from capture_megatron.config.training import DataOptions
from capture_megatron.data.corpus import stdlib_corpus
from capture_megatron.data.preprocess import preprocess
from capture_megatron.data.tokenizers import TokenizerOptions
from capture_megatron.errors import CaptureError
from capture_megatron.train import data as td

SEQ, MBS, GBS, ITERS, SEED = 32, 2, 8, 6, 1234


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("data")
    stdlib_corpus(str(root / "corpus.jsonl"), max_bytes=40_000)
    return preprocess(
        str(root / "corpus.jsonl"), str(root / "corpus"), TokenizerOptions(), append_eod=True
    ).prefixes[0]


@pytest.fixture(scope="module")
def z_prefix(tmp_path_factory) -> str:
    """A second dataset of nothing but 'z' bytes, to tell blended samples apart."""
    root = tmp_path_factory.mktemp("zdata")
    (root / "z.txt").write_text("\n\n".join("z" * (50 + 7 * i) for i in range(40)))
    return preprocess(
        str(root / "z.txt"), str(root / "z"), TokenizerOptions(), append_eod=False
    ).prefixes[0]


def _iters(opts, dp_rank=0, dp_size=1, consumed=0, chunks=1, mbs=MBS, gbs=GBS, iters=ITERS):
    return td.build_train_iterators(
        opts, SEQ, mbs, gbs, iters, dp_rank, dp_size, SEED, consumed, chunks
    )


def _rows(batches) -> list[tuple]:
    """Micro-batches as a flat list of (tokens row, labels row) tuples, in order."""
    return [
        (tuple(b["tokens"][i].tolist()), tuple(b["labels"][i].tolist()))
        for b in batches
        for i in range(b["tokens"].shape[0])
    ]


def test_batches_shapes_labels_and_masks(prefix):
    its = _iters(DataOptions(data_path=(prefix,)), chunks=2)
    first = list(its[0])
    assert len(first) == ITERS * GBS // MBS
    for b in first:
        assert sorted(b) == sorted(td.BATCH_KEYS)
        assert all(v.shape == (MBS, SEQ) and v.device.type == "cpu" for v in b.values())
        assert b["tokens"].dtype == b["labels"].dtype == b["position_ids"].dtype == torch.int64
        assert torch.equal(
            b["tokens"][:, 1:], b["labels"][:, :-1]
        )  # labels are tokens shifted by one
        assert torch.equal(b["position_ids"], torch.arange(SEQ).expand(MBS, SEQ))
        assert torch.equal(b["loss_mask"], torch.ones(MBS, SEQ))
        assert int(b["tokens"].max()) <= 256
    assert _rows(first) == _rows(its[1])  # every model chunk sees the same micro-batches
    assert len(set(_rows(first))) > len(first)  # and they are real, varied text


def test_samples_are_corpus_text(prefix):
    import numpy

    ids = numpy.fromfile(prefix + ".bin", dtype=numpy.uint16)
    stream = bytes(
        numpy.where(ids == 256, 0, ids).astype(numpy.uint8)
    )  # EOD -> NUL, absent from the text
    batch = next(_iters(DataOptions(data_path=(prefix,)))[0])
    row = batch["tokens"][0].tolist() + [batch["labels"][0, -1].item()]
    segments = bytes(0 if i == 256 else i for i in row).split(b"\x00")
    assert sum(len(s) for s in segments) > SEQ // 2
    for segment in segments:  # every stretch between EODs is a stretch of one corpus document
        assert segment in stream


def test_eod_mask_loss(prefix):
    batches = list(_iters(DataOptions(data_path=(prefix,), eod_mask_loss=True))[0])
    tokens = torch.cat([b["tokens"] for b in batches])
    mask = torch.cat([b["loss_mask"] for b in batches])
    assert int((tokens == 256).sum()) > 0
    assert torch.equal(mask == 0, tokens == 256)


@pytest.mark.parametrize("mbs, dp", [(1, 2), (2, 2), (1, 4), (2, 4), (4, 2)])
def test_dp_ranks_together_see_the_single_process_samples(prefix, mbs, dp):
    opts = DataOptions(data_path=(prefix,))
    single = _rows(_iters(opts, mbs=mbs)[0])
    ranks = [_rows(_iters(opts, dp_rank=r, dp_size=dp, mbs=mbs)[0]) for r in range(dp)]
    per_step = mbs * dp
    assert all(len(r) == len(single) // dp for r in ranks)
    for step in range(
        len(single) // per_step
    ):  # Megatron's sampler: rank r takes slice r of each step
        merged = [row for r in range(dp) for row in ranks[r][step * mbs : (step + 1) * mbs]]
        assert merged == single[step * per_step : (step + 1) * per_step]
    for it in range(ITERS):  # hence each iteration's global batch is the same set for any DP size
        got = sorted(row for r in ranks for row in r[it * GBS // dp : (it + 1) * GBS // dp])
        assert got == sorted(single[it * GBS : (it + 1) * GBS])


@pytest.mark.parametrize("dp_rank, dp", [(0, 1), (1, 2)])
def test_resume_continues_where_an_uninterrupted_run_would(prefix, dp_rank, dp):
    opts = DataOptions(data_path=(prefix,))
    full = _rows(_iters(opts, dp_rank=dp_rank, dp_size=dp)[0])
    done = 4
    resumed = _rows(_iters(opts, dp_rank=dp_rank, dp_size=dp, consumed=done * GBS)[0])
    assert resumed == full[done * GBS // dp :]
    assert resumed != full[: len(resumed)]
    assert list(_iters(opts, consumed=ITERS * GBS)[0]) == []


def test_seed_changes_the_order(prefix):
    opts = DataOptions(data_path=(prefix,))
    a = _rows(td.build_train_iterators(opts, SEQ, MBS, GBS, ITERS, 0, 1, 1, 0, 1)[0])
    b = _rows(td.build_train_iterators(opts, SEQ, MBS, GBS, ITERS, 0, 1, 2, 0, 1)[0])
    assert sorted(a) != sorted(b) or a != b
    assert a != b


def test_mock_data(tmp_path):
    its = _iters(DataOptions(mock_data=True), chunks=2)
    batches = list(its[0])
    assert len(batches) == ITERS * GBS // MBS and _rows(batches) == _rows(its[1])
    assert all(torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1]) for b in batches)
    assert max(int(b["tokens"].max()) for b in batches) <= 256
    small = list(_iters(DataOptions(mock_data=True, mock_vocab_size=50))[0])
    tokens = torch.cat([b["tokens"] for b in small])
    assert (
        int(tokens.max()) == 49 and int((tokens == 49).sum()) > 0
    )  # ids fill the vocabulary, EOD = 49
    assert td.tokenizer_vocab_size(DataOptions(mock_data=True, mock_vocab_size=50)) == 50
    assert td.tokenizer_vocab_size(DataOptions(mock_data=True)) == 257


def test_weighted_blend_and_cache_path(prefix, z_prefix, tmp_path):
    cache = tmp_path / "cache"
    opts = DataOptions(data_path=(f"0.25 {prefix}", "0.75", z_prefix), data_cache_path=str(cache))
    rows = _rows(_iters(opts, iters=10)[0])
    z = sum(1 for tokens, _ in rows if set(tokens) <= {ord("z")})
    assert 0.6 < z / len(rows) < 0.9
    files = os.listdir(cache)
    assert any("BlendedDataset" in f for f in files) and any("GPTDataset" in f for f in files)
    assert rows == _rows(_iters(opts, iters=10)[0])  # cache hit gives the same samples
    plain = _rows(_iters(DataOptions(data_path=(prefix, z_prefix)))[0])
    assert any(set(t) <= {ord("z")} for t, _ in plain) and any(ord("z") not in t for t, _ in plain)


def test_parse_blend():
    assert td.parse_blend(("a",)) == (["a"], None)
    assert td.parse_blend(("a", "b")) == (["a", "b"], None)
    assert td.parse_blend(("0.3 a 0.7", "b")) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(CaptureError, match="mixes weights and prefixes"):
        td.parse_blend(("0.3", "a", "b", "c"))
    with pytest.raises(CaptureError, match="must be positive"):
        td.parse_blend(("0", "a", "1", "b"))


def test_missing_data_names_the_prefix_and_files(tmp_path, prefix):
    missing = str(tmp_path / "nothing")
    for call in (lambda o: td.check_data_paths(o), lambda o: _iters(o)):
        with pytest.raises(CaptureError) as err:
            call(DataOptions(data_path=(missing,)))
        msg = str(err.value)
        assert (
            missing in msg
            and "nothing.bin" in msg
            and "nothing.idx" in msg
            and "capture-megatron preprocess" in msg
        )
        assert msg.count("nothing.bin") == msg.count("nothing.idx") == 1, msg  # said once
        assert "neither exists" in msg
    (tmp_path / "half.bin").write_bytes(b"")
    with pytest.raises(CaptureError) as err:
        td.check_data_paths(DataOptions(data_path=(str(tmp_path / "half"),)))
    assert f"{tmp_path / 'half.idx'} is missing (found {tmp_path / 'half.bin'})" in str(err.value)
    with pytest.raises(CaptureError, match="ends in _text_document"):
        td.check_data_paths(DataOptions(data_path=(prefix + ".bin",)))
    td.check_data_paths(DataOptions(data_path=(prefix,)))


def test_bad_settings(prefix, tmp_path):
    opts = DataOptions(data_path=(prefix,))
    with pytest.raises(CaptureError, match="--global-batch-size 6 is not a multiple"):
        _iters(opts, dp_size=2, gbs=6)
    with pytest.raises(CaptureError, match="leaves nothing for training"):
        _iters(DataOptions(data_path=(prefix,), split="0,1,0"))
    with pytest.raises(CaptureError, match="must be 0 .* or at least 2"):
        DataOptions(mock_data=True, mock_vocab_size=-3)


def test_data_from_another_tokenizer_is_caught(tmp_path, prefix):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    src = tmp_path / "t.txt"
    src.write_text(
        "\n\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(60))
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        [src.read_text()],
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    out = preprocess(
        str(src),
        str(tmp_path / "bpe"),
        TokenizerOptions("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json")),
    )
    with pytest.raises(CaptureError, match="outside the tokenizer's vocabulary of 257"):
        list(itertools.islice(_iters(DataOptions(data_path=out.prefixes))[0], 3))
    good = DataOptions(
        data_path=out.prefixes,
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(tmp_path / "tokenizer.json"),
    )
    assert td.tokenizer_vocab_size(good) == 320
    assert int(next(_iters(good)[0])["tokens"].max()) >= 257
