"""Issue 13, item 5: the fast paths of the planner give the same answers as the slow ones.

- predict.table.peak_table equals rank_memory split by split (bit for bit), and the partitioner
  on tables returns the same partition as on single calls;
- the lazy Supply (profile only the pairs the throughput search visits) returns the same ranking
  as a model holding every pair, while asking for fewer pairs.
Profiled once on the fake CUDA device with a tiny model (slow)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from capture_megatron.config import GIB, Cluster, DdpOptions, ModelShape
from capture_megatron.forecast import layers_for, rank_memory
from capture_megatron.forecast.table import peak_table
from capture_megatron.planner import PlanOptions, Space, plan
from capture_megatron.planner.partition import min_max_partition
from capture_megatron.planner.search import rank_peak_fn, rank_table_fn
from capture_megatron.planner.space import candidates
from capture_megatron.planner.supply import needs_of
from capture_megatron.profile import memory_source

# one worker runs the module (make test: --dist loadgroup), so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fast_search")]

SHAPE = ModelShape(
    num_layers=12,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=500,
    dtype="bf16",
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
CLUSTER = Cluster(gpus=8, gpu_memory_bytes=8 * GIB)
SPACE = Space(tp=(1, 2), vpp=(1, 2), micro_batch_size=(1,), distributed_optimizer=(False,))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    asked: list[frozenset] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path_factory.mktemp("cache")))
        inner = memory_source(SHAPE, "fake-cuda", progress=False)

        def counting(needs):
            asked.append(needs)
            return inner(needs)

        counting.asked = asked  # type: ignore[attr-defined]
        yield counting


def _plans():
    return list(candidates(SHAPE, CLUSTER, 16, SPACE))


DDP = (
    DdpOptions(
        grad_reduce_in_bf16=True, defer_embedding_wgrad_compute=True, wgrad_deferral_limit=3
    ),
    DdpOptions(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", overlap_grad_reduce=True),
)
"""Gradient / optimizer-state settings the tables are also checked with (issue 26): a deferred
output-layer weight gradient, bf16 gradients, the precision-aware optimizer with buckets."""


def test_tables_equal_single_calls(source):
    plans = [p for p in _plans() if p.pp == 4 and p.tp == 2]
    model = source(needs_of(SHAPE, plans))
    more = [p.replace(distributed_optimizer=True, ddp=ddp) for p in plans[:2] for ddp in DDP]
    for p in plans + more:
        layers = layers_for(model, SHAPE, p)
        for rank in range(p.pp):
            table = peak_table(layers, SHAPE, p, rank, 5)
            for counts in itertools.product(range(6), repeat=p.vpp):
                one = rank_memory(layers, SHAPE, p, rank, counts).peak
                assert table[counts] == one, (p, counts)
        full = p.recompute.granularity == "full"
        fast = min_max_partition(
            12,
            p.pp,
            p.vpp,
            rank_peak_fn(model, SHAPE, p, full),
            1,
            rank_table_fn(model, SHAPE, p, full),
        )
        slow = min_max_partition(12, p.pp, p.vpp, rank_peak_fn(model, SHAPE, p, full))
        assert fast == slow, p


def test_lazy_search_equals_complete_model(source):
    options = PlanOptions(objective="throughput", space=SPACE, global_batch_size=16, top=3)
    complete = source(needs_of(SHAPE, _plans()))
    eager = plan(SHAPE, CLUSTER, options, complete)
    source.asked.clear()
    lazy = plan(SHAPE, CLUSTER, options, source)
    assert [e.plan for e in lazy.ranked] == [e.plan for e in eager.ranked]
    assert [e.peak for e in lazy.ranked] == [e.peak for e in eager.ranked]
    source.asked.clear()
    fastest = plan(SHAPE, CLUSTER, dataclasses.replace(options, top=1), source)
    assert fastest.best.plan == eager.best.plan
    assert len(source.asked[-1]) < len(needs_of(SHAPE, _plans()))  # not every pair was profiled
