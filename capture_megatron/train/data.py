"""Training micro-batches, built as Megatron-LM builds them.

Datasets: `BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built_on_rank,
GPTDatasetConfig(...))` for --data-path (one prefix, several, or a weighted blend 'w1 p1 w2 p2', cut
by --split), or `MockGPTDataset` for --mock-data, with `sizes[0] = train_iters * global_batch_size`
samples. Only the training split is built (the valid/test document ranges are still held out of it).

Order: Megatron-LM's `MegatronPretrainingSampler` -- global batches are consecutive runs of
`global_batch_size` samples; micro-batch j of DP rank r in the global batch starting at sample s
holds samples [s + j*mbs*dp + r*mbs, s + j*mbs*dp + (r+1)*mbs); `consumed_samples` skips samples
already trained (resume). The samples of one iteration, over all DP ranks, are therefore the same
for every DP size, which is what makes a DP run equal a single process.

Index caches: GPTDataset writes its document/sample/shuffle indices to --data-cache-path (default
`<prefix>/cache/GPTDataset_indices`). With torch.distributed initialized the builder builds on
global rank 0 first and the other ranks read after a barrier -- so `build_train_iterators` is
then collective: call it on every rank. On top of that rank 0 (or every process, without
torch.distributed) holds an exclusive file lock on the cache while building, so jobs started at
the same time over the same data never read half-written caches. The caches are read without
pickle and checked against their checksums first (train.data_cache): a damaged or crafted one is
set aside and built again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from capture_megatron.config.training import DataOptions
from capture_megatron.errors import CaptureError
from capture_megatron.train import data_cache

if TYPE_CHECKING:
    from megatron.core.datasets.blended_megatron_dataset_builder import TopLevelDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from capture_megatron.data.tokenizer_base import TokenizerBase
    from capture_megatron.megatron.training import Batch

Blend = tuple[list[str], list[float] | None]
"""--data-path as megatron-core's GPTDatasetConfig takes it: (prefixes, weights or None)."""

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""Megatron's GPT batch keys, in the order pretrain_gpt.get_batch lists them (no attention mask)."""


def data_tokenizer(opts: DataOptions) -> TokenizerBase:
    """The tokenizer of a run: --tokenizer-type's, or for --mock-data with `mock_vocab_size` a
    MockTokenizer whose ids fill exactly that vocabulary."""
    from capture_megatron.data.tokenizers import MockTokenizer, build_tokenizer

    if opts.mock_data and opts.mock_vocab_size:
        return MockTokenizer(opts.mock_vocab_size)
    return build_tokenizer(opts)


def tokenizer_vocab_size(opts: DataOptions) -> int:
    """Vocabulary size of the run's tokenizer (the model's --vocab-size when none is given)."""
    return int(data_tokenizer(opts).vocab_size)


def parse_blend(data_path: tuple[str, ...]) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights or None) from --data-path, as Megatron's get_blend_from_list reads it:
    'p1 p2 ...' or 'w1 p1 w2 p2 ...'; entries may themselves hold several space-separated words."""
    words = [w for item in data_path for w in str(item).split()]
    if not words:
        raise CaptureError(
            "--data-path is empty; give a dataset prefix written by `capture-megatron preprocess`"
        )
    if len(words) % 2 == 1:
        return words, None
    weights: list[float | None] = []
    for word in words[0::2]:
        try:
            weights.append(float(word))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return words, None
    if any(w is None for w in weights):
        raise CaptureError(
            f"--data-path {' '.join(words)}: mixes weights and prefixes; give either "
            "'PREFIX1 PREFIX2 ...' or 'WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ...'"
        )
    numbers = [w for w in weights if w is not None]  # all of them by now
    bad = [w for w in numbers if not w > 0]
    if bad:
        raise CaptureError(f"--data-path weights {bad} must be positive numbers")
    return words[1::2], numbers


def check_data_paths(opts: DataOptions) -> None:
    """CaptureError unless every --data-path prefix has its .bin and .idx files."""
    if opts.mock_data:
        return
    prefixes, _ = parse_blend(opts.data_path)
    for prefix in prefixes:
        wanted = [prefix + ".bin", prefix + ".idx"]
        missing = [p for p in wanted if not os.path.isfile(p)]
        if missing:
            hint = (
                " (the prefix of a preprocessed file ends in _text_document)"
                if os.path.isfile(prefix + "_text_document.idx")
                or prefix.endswith((".bin", ".idx"))
                else ""
            )
            found = [p for p in wanted if p not in missing]
            state = f"{missing[0]} is missing (found {found[0]})" if found else "neither exists"
            raise CaptureError(
                f"--data-path prefix {prefix!r} has no dataset: it needs {' and '.join(wanted)}, "
                f"and {state}{hint}; write one with `capture-megatron preprocess --input FILE "
                "--output-prefix PREFIX`"
            )
        problem = indexed_problem(prefix)
        if problem:
            raise CaptureError(
                f"--data-path prefix {prefix!r}: {problem}; the dataset is truncated or damaged: "
                "write it again with `capture-megatron preprocess` (or Megatron-LM's "
                "tools/preprocess_data.py)"
            )


_INDEX_HEADER = b"MMIDIDX\x00\x00"
_TOKEN_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
"""megatron-core's indexed dataset dtype codes -> bytes per token (indexed_dataset.DType)."""


def indexed_problem(prefix: str) -> str:
    """What is wrong with a Megatron indexed dataset's .idx / .bin pair ('' when sound): the
    .idx must hold its header and the arrays its counts promise (int32 lengths, int64 pointers,
    int64 document indices), and the .bin every token the last pointer and length name."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != _INDEX_HEADER:
            return f"{idx} has no indexed-dataset header ({size} bytes)"
        version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
        if version != 1 or code not in _TOKEN_BYTES:
            return f"{idx} has an unknown version {version} or token type {code}"
        want = 34 + 12 * sequences + 8 * documents
        if size < want:
            return f"{idx} has {size} bytes and its header promises {want}"
        if not sequences:
            return ""
        f.seek(34 + 4 * (sequences - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(34 + 4 * sequences + 8 * (sequences - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
    need = last_pointer + last_length * _TOKEN_BYTES[code]
    have = os.path.getsize(bin_)
    if have < need:
        return f"{bin_} has {have} bytes and its index names {need}"
    return ""


def _dataset_config(
    opts: DataOptions, tokenizer: TokenizerBase, seq_length: int, seed: int, blend: Blend | None
) -> GPTDatasetConfig:
    """Megatron-LM pretrain_gpt's GPTDatasetConfig for this run, training split only."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=opts.split,
        path_to_cache=(opts.data_cache_path or None) if not opts.mock_data else None,
        mmap_bin_files=True,
        # annotated MegatronTokenizerBase; Megatron-LM's pretrain_gpt passes legacy ones too
        tokenizer=tokenizer,  # type: ignore[arg-type]
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=opts.eod_mask_loss,
        create_attention_mask=False,
    )
    train = config.split_matrix[0] if config.split_matrix else None
    if train is None:
        raise CaptureError(
            f"--split {opts.split} leaves nothing for training; give the training split a "
            "positive weight, e.g. --split 969,30,1"
        )
    # annotated as ranges, but megatron-core's own holds None for a split of weight 0
    config.split_matrix = [train, None, None]  # type: ignore[list-item]
    return config


def _check_train_tokens(prefixes: list[str], config: GPTDatasetConfig) -> None:
    """CaptureError when a prefix's training range holds no token (GPTDataset would loop
    forever)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert config.split_matrix is not None, "_dataset_config sets it"
    beg_f, end_f = config.split_matrix[0]
    for prefix in prefixes:
        indexed = IndexedDataset(
            prefix, multimodal=False, mmap=True
        )  # keep alive: lengths view its mmap
        lengths = indexed.sequence_lengths
        beg, end = int(round(beg_f * len(lengths))), int(round(end_f * len(lengths)))
        tokens, count = int(lengths[beg:end].sum()), len(lengths)
        del lengths, indexed
        if tokens == 0:
            raise CaptureError(
                f"--data-path {prefix!r}: the training part of --split {config.split} holds no "
                f"tokens ({count} documents in all); add documents or give training "
                "a larger share of --split"
            )


@contextlib.contextmanager
def _rank_zero_without_process_group() -> Iterator[None]:
    """megatron-core 0.16.1's BlendedDataset calls torch.distributed.get_rank() unguarded when it
    misses its cache; without a process group this process is rank 0."""
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        original = torch.distributed.get_rank
        torch.distributed.get_rank = lambda group=None: 0
        try:
            yield
        finally:
            torch.distributed.get_rank = original
    else:
        yield


@contextlib.contextmanager
def _quiet_mock_cache_warning(mock: bool) -> Iterator[None]:
    """MockGPTDataset is built in memory on purpose: drop megatron's 'Unable to save' warning."""
    log = logging.getLogger("megatron.core.datasets.gpt_dataset")
    level = log.level
    if mock:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def build_train_dataset(
    opts: DataOptions, seq_length: int, num_samples: int, seed: int
) -> TopLevelDataset:
    """The training dataset (GPTDataset, BlendedDataset or MockGPTDataset) with >= num_samples
    samples. Collective when torch.distributed is initialized (see the module docstring)."""
    tokenizer = data_tokenizer(opts)  # imports megatron-core quietly
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    prefixes: list[str] = []
    blend = None
    if not opts.mock_data:
        check_data_paths(opts)
        prefixes, weights = parse_blend(opts.data_path)
        blend = (prefixes, weights)
    config = _dataset_config(opts, tokenizer, seq_length, seed, blend)
    if prefixes:
        _check_train_tokens(prefixes, config)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    writer = not dist or torch.distributed.get_rank() == 0
    cls = MockGPTDataset if opts.mock_data else GPTDataset
    data_cache.install()  # index caches: never unpickled, checksummed when written
    dirs = data_cache.cache_dirs(opts, prefixes)
    with (
        data_cache.build_lock(dirs, writer),
        _rank_zero_without_process_group(),
        _quiet_mock_cache_warning(opts.mock_data),
        warnings.catch_warnings(),
    ):
        for note in data_cache.heal(dirs) if writer else []:
            print(f"note: {note}", flush=True)
        warnings.filterwarnings("ignore", message=".*pad token id.*collides.*")
        builder = BlendedMegatronDatasetBuilder(cls, [num_samples, 0, 0], lambda: True, config)
        dataset = builder.build()[0]
    if dataset is None or len(dataset) < num_samples:
        raise CaptureError(
            f"the training data yields {0 if dataset is None else len(dataset)} samples of "
            f"{seq_length} tokens, fewer than the {num_samples} that --train-iters x "
            "--global-batch-size need; add data or lower them"
        )
    return dataset


def sample_ranges(
    consumed_samples: int, total_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> Iterator[range]:
    """Megatron's MegatronPretrainingSampler: this DP rank's sample indices, one range per
    micro-batch."""
    step = micro_batch_size * dp_size
    start = consumed_samples
    while start + step <= total_samples:
        first = start + dp_rank * micro_batch_size
        yield range(first, first + micro_batch_size)
        start += step


def collate(samples: list[dict[str, Any]], vocab_size: int | None = None) -> Batch:
    """Stack GPTDataset samples into a micro-batch of Megatron's batch keys ([b, s] tensors);
    CaptureError when a token id is outside `vocab_size` (data made with another tokenizer)."""
    batch = {key: torch.stack([s[key] for s in samples]) for key in BATCH_KEYS}
    if vocab_size is not None:
        top = int(batch["tokens"].max())
        if top >= vocab_size:
            raise CaptureError(
                f"the data holds token id {top}, outside the tokenizer's vocabulary of "
                f"{vocab_size}; it was preprocessed with another tokenizer: "
                "give that one's --tokenizer-type"
            )
    return batch


def _micro_batches(
    dataset: TopLevelDataset, ranges: Iterator[range], vocab_size: int
) -> Iterator[Batch]:
    """Micro-batches of `dataset` for the given sample ranges."""
    for indices in ranges:
        yield collate([dataset[i] for i in indices], vocab_size)


def build_train_iterators(
    opts: DataOptions,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    train_iters: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    consumed_samples: int,
    num_chunks: int,
) -> list[Iterator[Batch]]:
    """One iterator per model chunk (virtual pipeline stage), each yielding this DP rank's
    micro-batches -- dicts of CPU tensors `tokens`, `labels`, `loss_mask`, `position_ids`, each
    [micro_batch_size, seq_length] -- for iterations after `consumed_samples`, in Megatron's order.
    Collective when torch.distributed is initialized: call it on every rank."""
    problems = []
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        problems.append(f"micro-batch {micro_batch_size}, dp rank {dp_rank} of {dp_size}")
    elif global_batch_size % (micro_batch_size * dp_size):
        problems.append(
            f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
            f"{micro_batch_size} x data-parallel size {dp_size}"
        )
    if consumed_samples < 0 or num_chunks < 1 or train_iters < 1 or seq_length < 1:
        problems.append(
            f"consumed samples {consumed_samples}, chunks {num_chunks}, iterations {train_iters}, "
            f"sequence length {seq_length}"
        )
    if problems:
        raise CaptureError("invalid data-loader settings: " + "; ".join(problems))
    total = train_iters * global_batch_size
    dataset = build_train_dataset(opts, seq_length, total, seed)
    vocab = int(data_tokenizer(opts).vocab_size)
    return [
        _micro_batches(
            dataset,
            sample_ranges(consumed_samples, total, micro_batch_size, dp_rank, dp_size),
            vocab,
        )
        for _ in range(num_chunks)
    ]
