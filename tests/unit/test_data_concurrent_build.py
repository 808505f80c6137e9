"""Several processes building the same dataset index caches at once: with torch.distributed (rank 0
first, then a barrier) and without (a file lock). Each pair of processes starts at the same time."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from capture_megatron.config.training import DataOptions
from capture_megatron.data.corpus import stdlib_corpus
from capture_megatron.data.preprocess import preprocess
from capture_megatron.data.tokenizers import TokenizerOptions
from capture_megatron.train.data import build_train_iterators

pytestmark = pytest.mark.slow  # spawns processes (gloo groups)

SEQ, MBS, GBS, ITERS, SEED = 32, 2, 8, 4, 7

CHILD = textwrap.dedent("""
    import os, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from capture_megatron.train.data import build_train_iterators
    from capture_megatron.config.training import DataOptions
    prefix, out, store = sys.argv[1], sys.argv[2], sys.argv[5]
    rank, world = int(sys.argv[3]), int(sys.argv[4])
    dp_rank, dp_size = 0, 1
    if store != "-":
        torch.distributed.init_process_group(
            "gloo", init_method="file://" + store, rank=rank, world_size=world
        )
        dp_rank, dp_size = rank, world
    its = build_train_iterators(
        DataOptions(data_path=(prefix,)), {SEQ}, {MBS}, {GBS}, {ITERS}, dp_rank, dp_size,
        {SEED}, 0, 1
    )
    torch.save([b["tokens"] for b in its[0]], out)
    if store != "-":
        torch.distributed.destroy_process_group()
""").format(SEQ=SEQ, MBS=MBS, GBS=GBS, ITERS=ITERS, SEED=SEED)


@pytest.fixture()
def fresh_prefix(tmp_path) -> str:
    stdlib_corpus(str(tmp_path / "corpus.jsonl"), max_bytes=40_000)
    return preprocess(
        str(tmp_path / "corpus.jsonl"), str(tmp_path / "c"), TokenizerOptions(), append_eod=True
    ).prefixes[0]


def _run_pair(tmp_path, prefix: str, distributed: bool) -> list[list[torch.Tensor]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    store = str(tmp_path / "store") if distributed else "-"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), prefix, str(tmp_path / f"out{r}.pt"), str(r), "2", store],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=120)
        assert p.returncode == 0, output
    return [torch.load(tmp_path / f"out{r}.pt") for r in range(2)]


def _single(prefix: str) -> list[torch.Tensor]:
    its = build_train_iterators(
        DataOptions(data_path=(prefix,)), SEQ, MBS, GBS, ITERS, 0, 1, SEED, 0, 1
    )
    return [b["tokens"] for b in its[0]]


def _cache_files(prefix: str) -> list[str]:
    return sorted(os.listdir(os.path.join(prefix, "cache", "GPTDataset_indices")))


def test_simultaneous_processes_without_process_group(tmp_path, fresh_prefix):
    first, second = _run_pair(tmp_path, fresh_prefix, distributed=False)
    assert len(first) == ITERS * GBS // MBS
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(a, b) for a, b in zip(first, _single(fresh_prefix)))
    # description + document/sample/shuffle indices, each index with its checksum (data_cache)
    assert len(_cache_files(fresh_prefix)) == 4 + 3
    assert os.path.isfile(os.path.join(fresh_prefix, "cache", ".capture-megatron-build.lock"))


def test_two_ranks_with_gloo_build_rank_zero_first(tmp_path, fresh_prefix):
    rank0, rank1 = _run_pair(tmp_path, fresh_prefix, distributed=True)
    single = _single(fresh_prefix)
    assert len(rank0) == len(rank1) == len(single) // 2
    for step, (a, b) in enumerate(zip(rank0, rank1)):  # DP rank r holds slice r of each mbs*dp step
        assert torch.equal(torch.cat([a, b]), torch.cat(single[2 * step : 2 * step + 2]))
    assert len(_cache_files(fresh_prefix)) == 4 + 3  # with the indices' checksums
