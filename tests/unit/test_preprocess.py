"""`capture-megatron preprocess`: Megatron's IndexedDataset reads back exactly the tokens
written."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy
import pytest

from capture_megatron.cli import preprocess as cli_preprocess
from capture_megatron.data import preprocess as pp
from capture_megatron.data.corpus import stdlib_corpus
from capture_megatron.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, TokenizerOptions
from capture_megatron.errors import CaptureError


def _read(prefix: str) -> list[numpy.ndarray]:
    """Every document of an indexed dataset as one token array (all its sequences)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    docs = ds.document_indices
    out = [
        numpy.concatenate([ds[i] for i in range(docs[d], docs[d + 1])])
        if docs[d + 1] > docs[d]
        else numpy.zeros(0, dtype=ds.index.dtype)
        for d in range(len(docs) - 1)
    ]
    out.append(ds.index.dtype)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    stdlib_corpus(str(path), max_bytes=60_000)
    return str(path)


def _texts(path: str) -> list[str]:
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


def test_jsonl_round_trip_with_eod(tmp_path, corpus, capsys):
    assert (
        cli_preprocess.main(
            ["--input", corpus, "--output-prefix", str(tmp_path / "out" / "c"), "--append-eod"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    texts = _texts(corpus)
    *docs, dtype = _read(str(tmp_path / "out" / "c_text_document"))
    tok = ByteTokenizer()
    assert dtype == numpy.uint16 and len(docs) == len(texts) > 50
    for text, doc in zip(texts, docs):
        assert doc.tolist() == tok.tokenize(text) + [256]
    tokens = sum(len(d) for d in docs)
    assert f"{len(texts):,} documents, {tokens:,} tokens" in printed
    assert "--data-path " + str(tmp_path / "out" / "c_text_document") in printed
    assert not [f for f in os.listdir(tmp_path / "out") if ".tmp" in f]


def test_no_append_eod_and_huggingface_tokenizer(tmp_path, corpus):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _texts(corpus),
        trainers.BpeTrainer(
            vocab_size=350,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    result = pp.preprocess(
        corpus,
        str(tmp_path / "h"),
        TokenizerOptions("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json")),
        append_eod=False,
    )
    *docs, _ = _read(result.prefixes[0])
    texts = _texts(corpus)
    assert result.documents == len(docs) == len(texts) and result.vocab_size == 350
    assert [d.tolist() for d in docs] == [hf.tokenize(t) for t in texts]
    assert all(hf.eod not in d for d in docs)
    assert result.tokens == sum(len(d) for d in docs)


def test_plain_text_paragraphs_are_documents(tmp_path):
    src = tmp_path / "notes.txt"
    src.write_text("first paragraph\nstill first\n\n\n  \nsecond one\n\nthird\n", encoding="utf-8")
    result = pp.preprocess(str(src), str(tmp_path / "t"), TokenizerOptions(), append_eod=True)
    *docs, _ = _read(result.prefixes[0])
    decoded = [ByteTokenizer().detokenize(d) for d in docs]
    assert decoded == ["first paragraph\nstill first", "second one", "third"]
    assert all(d[-1] == 256 for d in docs)
    assert result.prefixes == (str(tmp_path / "t_text_document"),)


def test_several_keys_sentence_lists_and_empty_documents(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [
        {"text": "abc", "title": "T1"},
        {"text": ["one. ", "two."], "title": "T2"},
        {"text": "", "title": ""},
        {"text": "z", "title": "T4"},
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    result = pp.preprocess(
        str(src),
        str(tmp_path / "k"),
        TokenizerOptions(),
        json_keys=("text", "title"),
        append_eod=True,
    )
    assert result.documents == 3 and result.skipped == 1
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    text = IndexedDataset(str(tmp_path / "k_text_document"))
    assert text.sequence_lengths.tolist() == [
        4,
        5,
        5,
        2,
    ]  # "two." carries the EOD; sentences kept apart
    assert text.document_indices.tolist() == [0, 1, 3, 4]
    *titles, _ = _read(str(tmp_path / "k_title_document"))
    assert [ByteTokenizer().detokenize(t) for t in titles] == ["T1", "T2", "T4"]


def test_workers_write_identical_files(tmp_path, corpus):
    one = pp.preprocess(corpus, str(tmp_path / "w1"), TokenizerOptions(), workers=1)
    two = pp.preprocess(corpus, str(tmp_path / "w2"), TokenizerOptions(), workers=2)
    for suffix in (".bin", ".idx"):
        first, second = Path(one.prefixes[0] + suffix), Path(two.prefixes[0] + suffix)
        assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', r"line 3 is not valid JSON"),
        (
            '{"text": "ok"}\n{"body": "no text"}\n',
            r"line 2 has no key 'text' \(it has \['body'\]\); pass --json-keys",
        ),
        ('["a list"]\n', r"line 1 is a JSON list, not an object"),
        ('{"text": 5}\n', r"line 1: 'text' holds a int"),
        ('\n\n{"text": ""}\n', r"holds no document with any token"),
    ],
)
def test_bad_input_lines(tmp_path, content, match):
    src = tmp_path / "bad.jsonl"
    src.write_text(content, encoding="utf-8")
    with pytest.raises(CaptureError, match=match):
        cli_preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "o")])
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing half-written left behind


def test_bad_input_files(tmp_path):
    with pytest.raises(CaptureError, match=r"--input '.*missing.jsonl' does not exist"):
        cli_preprocess.main(
            ["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o")]
        )
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(CaptureError, match="is empty"):
        cli_preprocess.main(
            ["--input", str(tmp_path / "empty.jsonl"), "--output-prefix", str(tmp_path / "o")]
        )
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(
        CaptureError, match="--json-keys body does not apply to the plain-text input"
    ):
        cli_preprocess.main(
            [
                "--input",
                str(tmp_path / "a.txt"),
                "--json-keys",
                "body",
                "--output-prefix",
                str(tmp_path / "o"),
            ]
        )
    with pytest.raises(CaptureError, match="needs --tokenizer-model"):
        cli_preprocess.main(
            [
                "--input",
                str(tmp_path / "a.txt"),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--output-prefix",
                str(tmp_path / "o"),
            ]
        )
    with pytest.raises(CaptureError, match="--tokenizer-type 'Tiktoken' is not supported"):
        cli_preprocess.main(
            [
                "--input",
                str(tmp_path / "a.txt"),
                "--tokenizer-type",
                "Tiktoken",
                "--output-prefix",
                str(tmp_path / "o"),
            ]
        )
    with pytest.raises(CaptureError, match="--workers 0 must be at least 1"):
        cli_preprocess.main(
            [
                "--input",
                str(tmp_path / "a.txt"),
                "--workers",
                "0",
                "--output-prefix",
                str(tmp_path / "o"),
            ]
        )


def test_eod_is_appended_only_when_asked_as_in_megatron_lm(tmp_path, capsys):
    """Megatron-LM's tools/preprocess_data.py appends EOD only with --append-eod; so does ours."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ab"}\n{"text": "c"}\n', encoding="utf-8")
    for name, extra in (("plain", []), ("eod", ["--append-eod"])):
        argv = ["--input", str(src), "--output-prefix", str(tmp_path / name), *extra]
        assert cli_preprocess.main(argv) == 0
    *plain, _ = _read(str(tmp_path / "plain_text_document"))
    *eod, _ = _read(str(tmp_path / "eod_text_document"))
    assert [d.tolist() for d in plain] == [[97, 98], [99]]
    assert [d.tolist() for d in eod] == [[97, 98, 256], [99, 256]]
    parser = argparse.ArgumentParser()
    cli_preprocess.add_arguments(parser)
    assert "off by default, as in Megatron-LM" in " ".join(parser.format_help().split())


@pytest.mark.parametrize("suffix, keep", [(".bin", 0.5), (".idx", 0.5), (".idx", 0.01)])
def test_truncated_dataset_is_named_before_training(tmp_path, corpus, suffix, keep):
    """Issue 29 item 9: a truncated .bin / .idx was a numpy ValueError from inside megatron-core;
    it is one paragraph saying the dataset is truncated, before any process starts."""
    from capture_megatron.train.entry import parse_config

    prefix = str(tmp_path / "c")
    assert cli_preprocess.main(["--input", corpus, "--output-prefix", prefix]) == 0
    prefix += "_text_document"
    model = "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8".split()
    parse_config([*model, "--data-path", prefix], 1)  # sound
    path = Path(prefix + suffix)
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    with pytest.raises(CaptureError, match="the dataset is truncated or damaged") as err:
        parse_config([*model, "--data-path", prefix], 1)
    assert str(path) in str(err.value)
