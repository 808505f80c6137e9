"""`capture-megatron preprocess`: text or JSON lines -> Megatron's indexed dataset (.bin/.idx).

Modelled on Megatron-LM's tools/preprocess_data.py and writing the same files, so the result also
trains under Megatron-LM: `<output-prefix>_<key>_document.bin/.idx` per JSON key (`--json-keys text`
by default), one document per JSON line (a list of strings gives one sequence per sentence, as
Megatron's), token dtype uint16 when the vocabulary is under 65,500, else int32 (Megatron's
`DType.optimal_dtype`). As there, the EOD token ends each document only with `--append-eod` (off by
default; a GPT corpus usually wants it, so that training sees where documents end). Differences
from Megatron-LM: a `.txt`/`.md` input is read as plain text whose blank-line-separated paragraphs
are the documents; documents that tokenize to nothing are skipped. Files are written under
temporary names and renamed at the end, so an error never leaves half a dataset behind.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from capture_megatron.data.tokenizers import TokenizerOptions
from capture_megatron.errors import CaptureError

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from capture_megatron.data.tokenizer_base import TokenizerBase

Document = tuple[tuple[str, ...], ...]
"""One document: per JSON key, its sentences."""
Encoded = tuple[tuple[list[int], list[int]], ...]
"""One tokenized document: per JSON key, (token ids, sequence lengths)."""

TEXT_SUFFIXES = (".txt", ".text", ".md")
"""Inputs with these suffixes are plain text (paragraphs = documents); anything else is JSON
lines."""

PROGRESS_MIN_BYTES = 1 << 20
"""Inputs at least this large show a tqdm progress bar."""

BATCH_DOCS = 256
"""Documents tokenized per batch (per pool.map call when --workers > 1)."""


@dataclass(frozen=True)
class PreprocessResult:
    """What one preprocess run wrote."""

    prefixes: tuple[str, ...]
    """Dataset prefixes written (one per JSON key), for --data-path."""
    documents: int
    """Documents written (per key)."""
    tokens: int
    """Tokens written over all keys, EOD included."""
    skipped: int
    """Documents left out because they tokenized to nothing."""
    vocab_size: int
    """The tokenizer's vocabulary."""
    dtype: str
    """Token dtype in the .bin file (uint16 or int32)."""


def _json_documents(path: str, keys: list[str]) -> Iterator[tuple[Document | None, int]]:
    """(per-key texts, bytes read) for each non-blank JSON line; CaptureError names the bad line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                yield None, len(raw)
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise CaptureError(
                    f"{path} line {number} is not valid JSON ({err}); each line must be one "
                    'JSON object such as {"text": "..."}'
                ) from None
            if not isinstance(obj, dict):
                raise CaptureError(
                    f"{path} line {number} is a JSON {type(obj).__name__}, not an object; each "
                    'line must be one JSON object such as {"text": "..."}'
                )
            yield tuple(_field(obj, key, path, number) for key in keys), len(raw)


def _field(obj: dict, key: str, path: str, number: int) -> tuple[str, ...]:
    """The sentences under `key`: a string is one, a list of strings is several."""
    if key not in obj:
        raise CaptureError(
            f"{path} line {number} has no key {key!r} (it has {sorted(obj)}); pass --json-keys "
            "with the key that holds the text"
        )
    value = obj[key]
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise CaptureError(
        f"{path} line {number}: {key!r} holds a {type(value).__name__}, not a string or a list "
        "of strings"
    )


def _text_documents(path: str) -> Iterator[tuple[Document | None, int]]:
    """(paragraph, bytes read) for each blank-line-separated paragraph of a text file."""
    lines: list[str] = []
    size = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            size += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise CaptureError(
                    f"{path} line {number} is not UTF-8 ({err.reason}); convert the file to UTF-8"
                ) from None
            if line.strip():
                lines.append(line.rstrip("\r\n"))
                continue
            if lines:
                yield (("\n".join(lines),),), size
                lines, size = [], 0
            else:
                yield None, size
                size = 0
    if lines or size:
        yield ((("\n".join(lines),),) if lines else None), size


_WORKER_TOKENIZER: TokenizerBase | None = None


def _init_worker(opts: TokenizerOptions) -> TokenizerBase:
    """Pool initializer: one tokenizer per process (returned too)."""
    global _WORKER_TOKENIZER
    from capture_megatron.data.tokenizers import build_tokenizer

    _WORKER_TOKENIZER = build_tokenizer(opts)
    return _WORKER_TOKENIZER


def _encode(doc: Document, append_eod: bool = True) -> Encoded:
    """Per key: (token ids, sequence lengths) of one document, EOD appended to the last sequence."""
    tok = _WORKER_TOKENIZER
    assert tok is not None, "_init_worker runs first"
    out = []
    for sentences in doc:
        ids: list[int] = []
        lengths: list[int] = []
        for sentence in sentences:
            piece = tok.tokenize(sentence)
            if len(piece):
                ids.extend(int(i) for i in piece)
                lengths.append(len(piece))
        if ids and append_eod:
            ids.append(tok.eod)
            lengths[-1] += 1
        out.append((ids, lengths))
    return tuple(out)


def _batches(
    docs: Iterable[tuple[Document | None, int]], size: int
) -> Iterator[tuple[list[Document], int]]:
    """Lists of up to `size` documents (blank entries dropped), with the bytes each list covers."""
    batch: list[Document] = []
    nbytes = 0
    for doc, n in docs:
        nbytes += n
        if doc is not None:
            batch.append(doc)
        if len(batch) >= size:
            yield batch, nbytes
            batch, nbytes = [], 0
    if batch or nbytes:
        yield batch, nbytes


def _import_indexed_dataset() -> ModuleType:
    """megatron.core.datasets.indexed_dataset without megatron's import-time warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _check_input(path: str, keys: list[str]) -> bool:
    """True for a plain-text input; CaptureError for a missing or empty file or bad keys."""
    if not os.path.isfile(path):
        raise CaptureError(f"--input {path!r} does not exist; give a .jsonl file or a .txt file")
    if os.path.getsize(path) == 0:
        raise CaptureError(f"--input {path!r} is empty; give a file with at least one document")
    is_text = path.lower().endswith(TEXT_SUFFIXES)
    if is_text and keys != ["text"]:
        raise CaptureError(
            f"--json-keys {' '.join(keys)} does not apply to the plain-text input {path!r}; "
            "leave --json-keys out or give a .jsonl file"
        )
    if len(set(keys)) != len(keys) or not keys:
        raise CaptureError(f"--json-keys {' '.join(keys)}: give each key once")
    return is_text


def preprocess(
    input_path: str,
    output_prefix: str,
    tokenizer: TokenizerOptions,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    progress: bool = True,
) -> PreprocessResult:
    """Tokenize `input_path` into `<output_prefix>_<key>_document.bin/.idx` (see the module
    docstring)."""
    keys = list(json_keys)
    is_text = _check_input(input_path, keys)
    if workers < 1:
        raise CaptureError(f"--workers {workers} must be at least 1")
    tok = _init_worker(tokenizer)
    ids_mod = _import_indexed_dataset()
    dtype = ids_mod.DType.optimal_dtype(tok.vocab_size)
    prefixes = tuple(f"{output_prefix}_{key}_document" for key in keys)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = [p + ".tmp" for p in prefixes]
    builders = [ids_mod.IndexedDatasetBuilder(t + ".bin", dtype=dtype) for t in tmp]
    docs = _text_documents(input_path) if is_text else _json_documents(input_path, keys)
    try:
        counts = _run(
            docs,
            builders,
            tokenizer,
            append_eod,
            workers,
            progress and os.path.getsize(input_path) >= PROGRESS_MIN_BYTES,
            os.path.getsize(input_path),
        )
        if counts[0] == 0:
            raise CaptureError(
                f"--input {input_path!r} holds no document with any token; give a file with text"
            )
        for builder, t, p in zip(builders, tmp, prefixes):
            builder.finalize(t + ".idx")
            os.replace(t + ".bin", p + ".bin")
            os.replace(t + ".idx", p + ".idx")
    finally:
        for builder, t in zip(builders, tmp):
            builder.data_file.close()
            for suffix in (".bin", ".idx"):
                if os.path.exists(t + suffix):
                    os.remove(t + suffix)
    return PreprocessResult(
        prefixes=prefixes,
        documents=counts[0],
        tokens=counts[1],
        skipped=counts[2],
        vocab_size=tok.vocab_size,
        dtype=dtype.__name__,
    )


def _run(
    docs: Iterable[tuple[Document | None, int]],
    builders: list[IndexedDatasetBuilder],
    tokenizer: TokenizerOptions,
    append_eod: bool,
    workers: int,
    bar: bool,
    total_bytes: int,
) -> tuple[int, int, int]:
    """Tokenize and write all documents; returns (documents, tokens, skipped)."""
    from functools import partial

    from tqdm import tqdm

    written = tokens = skipped = 0
    encode = partial(_encode, append_eod=append_eod)
    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context(
            "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        )
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,))
    try:
        with tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=not bar
        ) as pbar:
            for batch, nbytes in _batches(docs, BATCH_DOCS * workers):
                encoded = (
                    pool.map(encode, batch, chunksize=16) if pool else [encode(d) for d in batch]
                )
                for doc in encoded:
                    if not any(ids for ids, _ in doc):
                        skipped += 1
                        continue
                    for builder, (ids, lengths) in zip(builders, doc):
                        # megatron-core annotates a Tensor; it takes anything numpy.array reads,
                        # and Megatron-LM's tools/preprocess_data.py passes lists of ids too
                        builder.add_document(ids, lengths)  # type: ignore[arg-type]
                        tokens += len(ids)
                    written += 1
                pbar.update(nbytes)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return written, tokens, skipped
