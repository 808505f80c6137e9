"""`capture-megatron preprocess --input corpus.jsonl --output-prefix data/corpus`: text or JSONL ->
Megatron's indexed dataset (.bin/.idx), with Megatron-LM's tools/preprocess_data.py flag names."""

from __future__ import annotations

import argparse
import sys

from capture_megatron.data.preprocess import preprocess
from capture_megatron.data.tokenizers import TOKENIZER_TYPES, TokenizerOptions
from capture_megatron.flags.parser import HelpParser, summary
from capture_megatron.serial import writable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The preprocess flags (Megatron-LM's tools/preprocess_data.py names)."""
    g = parser.add_argument_group("input")
    g.add_argument(
        "--input",
        required=True,
        help="a .jsonl file (one JSON object per line) or a .txt/.md "
        "file whose blank-line-separated paragraphs are documents",
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON keys to extract (default: text)"
    )
    g = parser.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        default="ByteTokenizer",
        help=", ".join(TOKENIZER_TYPES) + " (default: ByteTokenizer, UTF-8 bytes, no files)",
    )
    g.add_argument(
        "--tokenizer-model",
        default="",
        help="tokenizer.json (HuggingFace) or .model (SentencePiece)",
    )
    g.add_argument("--vocab-file", default="", help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", default="", help="GPT-2 BPE merges.txt")
    g.add_argument(
        "--append-eod",
        dest="append_eod",
        action="store_true",
        default=False,
        help="end every document with the tokenizer's EOD token so that training sees where "
        "documents end (off by default, as in Megatron-LM's tools/preprocess_data.py)",
    )
    g.add_argument(  # the default since 0.3; still accepted from earlier command lines
        "--no-append-eod", dest="append_eod", action="store_false", help=argparse.SUPPRESS
    )
    g = parser.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")


def main(argv: list[str] | None = None) -> int:
    """`capture-megatron preprocess ...`; returns 0 (CaptureError on bad input)."""
    parser = HelpParser(
        prog="capture-megatron preprocess",
        description=summary(__doc__),
        example="--input corpus.jsonl --output-prefix data/corpus --tokenizer-type ByteTokenizer "
        "--append-eod",
    )
    add_arguments(parser)
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for key in ns.json_keys:  # every file it writes, before the corpus is read
        writable("--output-prefix", f"{ns.output_prefix}_{key}_document.bin")
    tok = TokenizerOptions(
        tokenizer_type=ns.tokenizer_type,
        tokenizer_model=ns.tokenizer_model,
        vocab_file=ns.vocab_file,
        merge_file=ns.merge_file,
    )
    result = preprocess(ns.input, ns.output_prefix, tok, ns.json_keys, ns.append_eod, ns.workers)
    for prefix in result.prefixes:
        print(f"wrote {prefix}.bin/.idx")
    print(
        f"{result.documents:,} documents, {result.tokens:,} tokens ({ns.tokenizer_type}, "
        f"vocabulary {result.vocab_size:,}, {result.dtype}"
        + (f"; {result.skipped:,} empty documents skipped" if result.skipped else "")
        + ")"
    )
    flags = [f"--tokenizer-type {ns.tokenizer_type}"] + [
        f"--{name.replace('_', '-')} {value}"
        for name, value in (
            ("tokenizer_model", ns.tokenizer_model),
            ("vocab_file", ns.vocab_file),
            ("merge_file", ns.merge_file),
        )
        if value
    ]
    print(f"train on it with --data-path {' '.join(result.prefixes)} {' '.join(flags)}")
    return 0
