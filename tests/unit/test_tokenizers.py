"""Offline tokenizers: round trips for every type on real tokenizer files trained here, and
errors."""

from __future__ import annotations

import json

import pytest

from capture_megatron.config.training import DataOptions
from capture_megatron.data.corpus import stdlib_corpus
from capture_megatron.data.tokenizers import (
    ByteTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TokenizerOptions,
    build_tokenizer,
)
from capture_megatron.errors import CaptureError

SAMPLES = [
    "Return the sum of a and b.",
    "Abstract Base Classes (ABCs) according to PEP 3119.\n\nUse it.",
    "  two  spaces, tabs\tand a trailing newline\n",
]


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    stdlib_corpus(str(path), max_bytes=120_000)
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, texts):
    """A byte-level BPE trained here: tokenizer.json plus GPT-2 style vocab.json / merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # vocab.json, merges.txt
    return out


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, texts) -> str:
    import sentencepiece as spm

    out = tmp_path_factory.mktemp("sp")
    lines = [line for t in texts for line in t.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(out / "sp"),
        vocab_size=800,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=2,
        minloglevel=2,
    )
    return str(out / "sp.model")


def test_byte_tokenizer_round_trip_and_specials():
    tok = build_tokenizer(TokenizerOptions())
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eod) == (257, 256)
    text = "naïve café — ∑ 日本"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.detokenize(ids + [tok.eod]) == text
    assert len(tok.vocab) == 257 and tok.inv_vocab[256] == "<|endoftext|>"


def test_tokenizers_are_megatron_tokenizers(bpe_dir, sp_model):
    """megatron-core 0.16's MegatronLegacyTokenizer is their base; 0.17 removed it, and
    capture_megatron.data.identified keeps its contract (the same unique identifiers)."""
    from capture_megatron.data.tokenizer_base import MegatronLegacyTokenizer

    for tok in (
        ByteTokenizer(),
        HuggingFaceTokenizer(str(bpe_dir / "tokenizer.json")),
        SentencePieceTokenizer(sp_model),
        GPT2BPETokenizer(str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt")),
    ):
        assert isinstance(tok, MegatronLegacyTokenizer)
        assert tok.unique_identifiers["class"] == type(tok).__name__
        assert 0 <= tok.eod < tok.vocab_size


def test_huggingface_round_trip(bpe_dir):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    tok = build_tokenizer(
        DataOptions(
            mock_data=True,
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(bpe_dir / "tokenizer.json"),
        )
    )
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.eod == ref.token_to_id("<|endoftext|>")
    assert tok.vocab_size == ref.get_vocab_size() == 400
    for text in SAMPLES:
        ids = tok.tokenize(text)
        assert ids == ref.encode(text).ids
        assert len(ids) < len(text.encode("utf-8"))  # merges were learnt and are used
        assert tok.detokenize(ids) == text
    folder = build_tokenizer(TokenizerOptions("HuggingFaceTokenizer", tokenizer_model=str(bpe_dir)))
    assert folder.tokenize(SAMPLES[0]) == tok.tokenize(SAMPLES[0])


def test_huggingface_eod_from_tokenizer_config(tmp_path, bpe_dir):
    from tokenizers import AddedToken, Tokenizer

    ref = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    ref.add_special_tokens([AddedToken("</s>", special=True)])
    ref.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.eod == ref.token_to_id("</s>") == 400
    assert tok.vocab_size == 401


def test_huggingface_without_eod_token_is_an_error(tmp_path, texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(texts[:50], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CaptureError, match="no end-of-document token"):
        HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))


def test_sentencepiece_round_trip(sp_model):
    import sentencepiece as spm

    ref = spm.SentencePieceProcessor(model_file=sp_model)
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        tok = build_tokenizer(TokenizerOptions(kind, tokenizer_model=sp_model))
        assert (tok.vocab_size, tok.eod) == (800, ref.eos_id())
        for text in SAMPLES + ["bytes fall back: ∑ 日本"]:
            ids = tok.tokenize(text)
            assert ids == ref.encode(text) and max(ids) < 800
            assert tok.detokenize(ids) == text


def test_gpt2_bpe_matches_the_same_model_and_round_trips(bpe_dir):
    tok = build_tokenizer(
        TokenizerOptions(
            "GPT2BPETokenizer",
            vocab_file=str(bpe_dir / "vocab.json"),
            merge_file=str(bpe_dir / "merges.txt"),
        )
    )
    hf = HuggingFaceTokenizer(str(bpe_dir / "tokenizer.json"))
    vocab = json.loads((bpe_dir / "vocab.json").read_text())
    assert tok.vocab_size == len(vocab) and tok.eod == vocab["<|endoftext|>"]
    for text in SAMPLES:
        assert tok.tokenize(text) == hf.tokenize(text)
        assert tok.detokenize(tok.tokenize(text)) == text


@pytest.mark.parametrize(
    "opts, match",
    [
        (TokenizerOptions("WordPiece"), "'WordPiece' is not supported; use one of ByteTokenizer"),
        (TokenizerOptions("HuggingFaceTokenizer"), "HuggingFaceTokenizer needs --tokenizer-model"),
        (
            TokenizerOptions("SentencePieceTokenizer"),
            "SentencePieceTokenizer needs --tokenizer-model",
        ),
        (
            TokenizerOptions("GPT2BPETokenizer", vocab_file="v.json"),
            "needs --vocab-file vocab.json --merge-file",
        ),
        (
            TokenizerOptions("HuggingFaceTokenizer", tokenizer_model="/nonexistent/tokenizer.json"),
            "'/nonexistent/tokenizer.json' does not exist",
        ),
        (
            TokenizerOptions("SentencePieceTokenizer", tokenizer_model="/nonexistent/x.model"),
            "'/nonexistent/x.model' does not exist",
        ),
    ],
)
def test_bad_tokenizer_flags(opts, match):
    with pytest.raises(CaptureError, match=match):
        build_tokenizer(opts)


def test_unreadable_tokenizer_files(tmp_path, bpe_dir):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(CaptureError, match="not a readable HuggingFace tokenizer.json"):
        build_tokenizer(TokenizerOptions("HuggingFaceTokenizer", tokenizer_model=str(bad)))
    with pytest.raises(CaptureError, match="not a SentencePiece model"):
        build_tokenizer(TokenizerOptions("SentencePieceTokenizer", tokenizer_model=str(bad)))
    with pytest.raises(CaptureError, match="--merge-file .* does not exist"):
        build_tokenizer(
            TokenizerOptions(
                "GPT2BPETokenizer",
                vocab_file=str(bpe_dir / "vocab.json"),
                merge_file=str(tmp_path / "missing.txt"),
            )
        )
    with pytest.raises(CaptureError, match="holds no tokenizer.json"):
        build_tokenizer(
            TokenizerOptions("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / ".."))
        )
