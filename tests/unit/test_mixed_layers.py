"""Dense and MoE layers in one model (--moe-layer-freq): chunks composed layer by layer, their
static layout, and the exact partition of layers that differ (issue 16, build item 3)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import GIB, Cluster, ParallelPlan
from capture_megatron.features.moe import Experts
from capture_megatron.fit import ShapeConstants
from capture_megatron.fit.model import KindConstants, Sizes
from capture_megatron.forecast import layers_for, mixed, predict, rank_peak
from capture_megatron.forecast.chunks import _activations, _uniform
from capture_megatron.forecast.static import chunk_static, layer_static
from capture_megatron.planner import PlanOptions, Space, balance, plan
from capture_megatron.planner.balance import located_peak_fn
from capture_megatron.planner.contiguous import contiguous_partition
from capture_megatron.planner.search import split_score_fn
from capture_megatron.planner.supply import needs_of

KINDS = ("first", "middle", "last", "only")


def _constants(rng: random.Random, scale: float = 1.0) -> ShapeConstants:
    """Random constants with the structure profiling gives (what one layer saves, keeps when
    recomputed, and the one-layer chunks' peaks)."""
    s = scale * rng.uniform(10, 100)
    kept = rng.uniform(0, 5)

    def kind(k: str) -> KindConstants:
        def v() -> float:
            return scale * rng.uniform(0, 200)

        return KindConstants(
            kind=k, input_bytes=0.0 if k in ("first", "only") else kept, saved1=s + v(),
            fwd1=s + v(), bwd1=v(), step1=v(), fwdrc=v(), bwdrc=v(), bwdmix=v(),
            buffers1=rng.choice([0.0, 8.0]),
        )  # fmt: skip

    z: Sizes = (1, 1, 1, 1, 1, 1, 1, 1, 1)  # type: ignore[assignment]
    return ShapeConstants(
        sizes=z,
        layer_saved=s,
        layer_saved_rc=rng.choice([0.0, kept]),
        layer_numels=(),
        chunks=tuple(kind(k) for k in KINDS),
        buffers=0.0,
        layer_saved_rc_next=kept,
    )


@pytest.mark.parametrize("seed", range(40))
def test_one_variant_chunks_compose_as_their_own_formulas(seed):
    """The layer-by-layer composition, given layers of one variant, is the one-variant formula
    (block and uniform recompute, every chunk kind, layer count and recompute count)."""
    rng = random.Random(seed)
    sc = _constants(rng)
    for kind, k in itertools.product(KINDS, range(1, 7)):
        for n in range(k + 1):
            got = mixed.block(lambda m: sc, kind, (True,) * k, n)
            assert got == pytest.approx(_activations(sc, kind, k, n), rel=1e-12), (kind, k, n)
            if n:
                got = mixed.uniform(lambda m: sc, kind, (False,) * k, n)
                assert got == pytest.approx(_uniform(sc, kind, k, n), rel=1e-12), (kind, k, n)


@pytest.mark.parametrize("seed", range(40))
def test_an_moe_layer_in_place_of_a_dense_one_never_lowers_a_chunk(seed):
    """With MoE layers weighing at least what dense ones do, turning any dense layer of a chunk
    into an MoE layer never lowers what it saves or its forward and backward peaks, and a chunk's
    costs lie between its all-dense and all-MoE twins."""
    rng = random.Random(seed)
    dense = _constants(rng)
    heavy = ShapeConstants(
        sizes=dense.sizes,
        layer_saved=dense.layer_saved * 2,
        layer_saved_rc=dense.layer_saved_rc,
        layer_numels=(),
        chunks=tuple(
            KindConstants(
                kind=c.kind,
                input_bytes=c.input_bytes,
                saved1=c.saved1 + dense.layer_saved,
                fwd1=c.fwd1 + 3 * dense.layer_saved,
                bwd1=c.bwd1 + 2 * dense.layer_saved,
                step1=c.step1,
                fwdrc=c.fwdrc,
                bwdrc=c.bwdrc,
                bwdmix=c.bwdmix,
            )  # fmt: skip
            for c in dense.chunks
        ),
        buffers=0.0,
        layer_saved_rc_next=dense.layer_saved_rc_next,
    )
    consts = {False: dense, True: heavy}.__getitem__
    for kind, k in itertools.product(KINDS, range(1, 6)):
        for moe in itertools.product((False, True), repeat=k):
            got = mixed.block(consts, kind, moe, 0)
            low = mixed.block(consts, kind, (False,) * k, 0)
            high = mixed.block(consts, kind, (True,) * k, 0)
            for i in range(1, 4):
                assert low[i] - 1e-9 <= got[i] <= high[i] + 1e-9, (kind, moe, i)
            for j in (j for j in range(k) if not moe[j]):
                more = mixed.block(consts, kind, moe[:j] + (True,) + moe[j + 1 :], 0)
                assert all(more[i] >= got[i] - 1e-9 for i in (1, 2)), (kind, moe, j)


@pytest.mark.parametrize("seed", range(200))
def test_static_of_mixed_layers_equals_the_element_layout(seed):
    """Runs of dense and MoE layers: the dense buffer holds every non-expert parameter in order,
    the expert buffer the routed experts' (each sharded over its own data-parallel ranks)."""
    rng = random.Random(seed)
    sizes = [1, 7, 64, 65, 100, 128, 1000, 4096]
    dense = tuple(rng.choice(sizes) for _ in range(rng.randint(1, 5)))
    moe = tuple(rng.choice(sizes) for _ in range(rng.randint(2, 6)))
    mask = tuple(rng.random() < 0.5 for _ in moe)
    runs = tuple(
        (dense, (False,) * len(dense), rng.randint(1, 4))
        if i % 2 == rng.randint(0, 1)
        else (moe, mask, rng.randint(1, 4))
        for i in range(rng.randint(1, 4))
    )
    pre = tuple(rng.randint(1, 5000) for _ in range(rng.randint(0, 2)))
    post = tuple(rng.randint(1, 5000) for _ in range(rng.randint(0, 2)))
    dp = (rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3]))
    flat = [(n, e) for lay, ex, k in runs for _ in range(k) for n, e in zip(lay, ex)]
    plain = list(pre) + [n for n, e in flat if not e] + list(post)
    routed = [n for n, e in flat if e]
    for dtype, distopt in itertools.product(("fp32", "bf16"), (False, True)):
        a = chunk_static(plain, dtype, dp[0], distopt)
        b = chunk_static(routed, dtype, dp[1], distopt)
        got = layer_static(pre, runs, post, dtype, dp, distopt)
        assert (got.params, got.grads, got.optimizer) == (
            a.params + b.params,
            a.grads + b.grads,
            a.optimizer + b.optimizer,
        ), (runs, dp)


def _range_cost(rng: random.Random, n: int, pp: int):
    """A predictor-like rank peak over a range of differing layers: static bytes per layer, in-
    flight micro-batches x what each layer saves, the largest layer's transient on top."""
    weight = [rng.choice([1.0, rng.uniform(2, 6)]) for _ in range(n)]
    saved = [w * rng.uniform(0.5, 2) for w in weight]
    base = [rng.uniform(0, 30) for _ in range(pp)]

    def cost(rank: int, start: int, count: int) -> float:
        layers = range(start, start + count)
        top = max((saved[i] * 3 for i in layers), default=0.0)
        held = (pp - rank) * sum(saved[i] for i in layers)
        return base[rank] + sum(weight[i] for i in layers) + held + top

    return cost


@pytest.mark.parametrize("seed", range(150))
def test_contiguous_partition_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    pp, unit = rng.randint(2, 4), rng.choice([1, 1, 2])
    n = unit * rng.randint(pp, 10 // unit + 1)
    cost = _range_cost(rng, n, pp)
    best = float("inf")
    for cut in itertools.combinations_with_replacement(range(0, n + 1, unit), pp - 1):
        bounds = (0,) + cut + (n,)
        best = min(best, max(cost(r, bounds[r], bounds[r + 1] - bounds[r]) for r in range(pp)))
    part = contiguous_partition(n, pp, cost, unit)
    assert sum(part.layers_per_stage) == n and all(k % unit == 0 for k in part.layers_per_stage)
    assert part.peak == pytest.approx(best, rel=1e-9)
    starts = [sum(part.layers_per_stage[:r]) for r in range(pp)]
    assert part.rank_peaks == tuple(cost(r, starts[r], part.layers_per_stage[r]) for r in range(pp))


MIXED = dataclasses.replace(
    SMALL,
    num_layers=10,
    moe=Experts(
        num_experts=4,
        moe_router_topk=2,
        moe_layer_freq="([0]*3+[1]*7)",
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
    ),
)
"""SMALL with 10 layers, the first three dense (DeepSeek's pattern), the rest MoE."""


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_plan_of_mixed_layers_is_the_best_split_and_predicts_where_layers_sit(recompute):
    """The min-peak split of dense and MoE layers is the best of every split of the layers over
    4 stages (each predicted for the layers it holds), and the same counts moved elsewhere in the
    model predict other peaks: a stage holding dense layers needs less than one holding MoE."""
    space = Space(tp=(2,), pp=(4,), vpp=(1,), micro_batch_size=(1,), recompute=(recompute,),
                  sequence_parallel=(True,), distributed_optimizer=(True,), ep=(2,))  # fmt: skip
    cluster = Cluster(gpus=16, gpu_memory_bytes=80 * GIB)
    options = PlanOptions(objective="min-peak", space=space, global_batch_size=32)
    best = plan(MIXED, cluster, options, synthetic_source).best
    model = synthetic_source(needs_of(MIXED, [best.plan]))
    assert {vm.variant.moe is None for vm in model.variants} == {True, False}
    layers = layers_for(model, MIXED, best.plan)
    assert layers.mixed and layers.chunk(2, 3) == (False, True, True)
    if recompute == "none":
        score = split_score_fn(model, MIXED, best.plan, False)
        brute = min(
            score(split).peak
            for split in itertools.product(range(11), repeat=4)
            if sum(split) == 10
        )
        assert best.peak == pytest.approx(brute, rel=1e-9)
        assert best.plan.layers_per_stage != (3, 3, 2, 2)  # not the count-balanced split
    rank = predict(model, MIXED, best.plan)
    assert tuple(s.peak for s in rank) == pytest.approx(best.rank_peaks, abs=1)
    dense_first = dataclasses.replace(best.plan, layers_per_stage=(3, 3, 2, 2))
    flipped = dataclasses.replace(
        MIXED, moe=dataclasses.replace(MIXED.moe, moe_layer_freq="([1]*7+[0]*3)")
    )
    a = predict(model, MIXED, dense_first)[0].params
    b = predict(model, flipped, dense_first)[0].params
    assert a < b  # stage 0 holds the three dense layers in MIXED, three MoE layers in `flipped`


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_interleaved_mixed_plans_are_no_worse_than_megatrons_splits(recompute):
    """With interleaving the split of dense and MoE layers comes from a local search: it needs no
    more than uniform or the best --decoder-first/last-pipeline-num-layers choice, and no single
    move of a layer lowers it."""
    space = Space(tp=(2,), pp=(2,), vpp=(2,), micro_batch_size=(1,), recompute=(recompute,),
                  sequence_parallel=(True,), distributed_optimizer=(True,), ep=(2,))  # fmt: skip
    cluster = Cluster(gpus=8, gpu_memory_bytes=80 * GIB)
    options = PlanOptions(objective="min-peak", space=space, global_batch_size=32)
    result = plan(MIXED, cluster, options, synthetic_source)
    best = result.best
    for b in result.baselines:
        assert b.partition is None or best.peak <= b.partition.peak + 1, b.name
    score = split_score_fn(synthetic_source(needs_of(MIXED, [best.plan])), MIXED, best.plan, False)
    split = best.plan.layers_per_stage
    for i, j in itertools.permutations(range(4), 2):
        if abs(i - j) == 1 and split[i]:
            moved = list(split)
            moved[i], moved[j] = moved[i] - 1, moved[j] + 1
            assert score(tuple(moved)).peak >= best.peak - 1


def test_located_peaks_of_chunks_alike_are_one_forecast(monkeypatch):
    """A rank's located peak (the min-max splits of dense and MoE layers) is rank_peak's for every
    placement, and placements whose chunks hold the same dense/MoE pattern share one forecast."""
    plan = ParallelPlan(tp=2, pp=2, dp=2, ep=2, vpp=2, micro_batch_size=1, global_batch_size=8,
                        layers_per_stage=(3, 2, 3, 2),
                        sequence_parallel=True, distributed_optimizer=True)  # fmt: skip
    model = synthetic_source(needs_of(MIXED, [plan]))
    layers = layers_for(model, MIXED, plan)
    forecasts = []

    def counted(*args: object) -> float:
        forecasts.append(args[3:])
        return rank_peak(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(balance, "rank_peak", counted)
    peak = located_peak_fn(model, MIXED, plan, False)
    for starts in itertools.product(range(8), repeat=2):
        for rank in range(2):
            got = peak(rank, (2, 2), starts)
            assert got == rank_peak(layers, MIXED, plan, rank, (2, 2), None, starts)
    patterns = {(r, layers.chunk(a, 2), layers.chunk(b, 2)) for r in range(2)
                for a, b in itertools.product(range(8), repeat=2)}  # fmt: skip
    assert len(forecasts) == len(patterns) < 2 * 64
