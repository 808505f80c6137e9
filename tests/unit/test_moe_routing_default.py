"""The default forecast of dropless MoE routing (issue 26, build item 4): the imbalance measured in
aux-loss-balanced training (capture_megatron/forecast/moe_routing.json, from bench/moe_routing.py)
is the default, the worst-case bound stays beside it, --moe-imbalance-factor sets the factor,
--moe-router-force-load-balancing means balanced routing, and capacity-factor routing is
unchanged. Planner logic on the synthetic memory model (no profiling)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from synthetic_memory import synthetic_source

from capture_megatron.api.request import resolve_shape
from capture_megatron.cli.predict import build_parser
from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan
from capture_megatron.features.moe import Experts
from capture_megatron.flags import parser as flags
from capture_megatron.forecast.routing import STATISTICS, routing_factor, statistics
from capture_megatron.forecast.support import experts_probe
from capture_megatron.planner import PlanOptions, Space, plan
from capture_megatron.planner.routing import routed

MIXTRAL_MOE = Experts(
    num_experts=8,
    moe_router_topk=2,
    moe_token_dispatcher_type="alltoall",
    moe_aux_loss_coeff=1e-2,
)
"""Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh routing (core_v0.16.1)."""


def _shape(**moe) -> ModelShape:
    return ModelShape(
        num_layers=8,
        hidden_size=1024,
        num_attention_heads=8,
        seq_length=4096,
        vocab_size=32000,
        dtype="bf16",
        add_bias_linear=False,
        moe=dataclasses.replace(MIXTRAL_MOE, **moe),
    )


def _plan(ep: int = 8, mbs: int = 1) -> ParallelPlan:
    return ParallelPlan(
        tp=1, pp=1, dp=8, ep=ep, micro_batch_size=mbs, global_batch_size=64, layers_per_stage=(8,)
    )


def test_dropless_default_is_the_measured_forecast_with_the_bound_beside():
    shape, plan_ = _shape(), _plan()
    f = routing_factor(shape, plan_)
    assert f.basis == "statistics" and "bench/moe_routing.py" in f.source
    assert 1.0 < f.forecast <= f.planning < f.bound == 4.0
    probe = experts_probe(shape, plan_)
    assert probe is not None and probe.bound == "imbalance"
    assert probe.experts.moe_expert_capacity_factor == f.forecast
    planning = experts_probe(routed(shape, "planning"), plan_)
    assert planning is not None and planning.experts.moe_expert_capacity_factor == f.planning
    worst = experts_probe(routed(shape, "bound"), plan_)
    assert worst is not None and worst.bound == "worst"
    assert worst.experts.moe_expert_capacity_factor == 4.0


def test_the_forecast_grows_with_ep_and_falls_with_tokens():
    shape = _shape()
    assert routing_factor(shape, _plan(ep=1)).forecast == 1.0  # every choice stays on the rank
    by_ep = [routing_factor(shape, _plan(ep=e)).forecast for e in (2, 4, 8)]
    assert by_ep == sorted(by_ep)
    short = dataclasses.replace(shape, seq_length=256)
    assert routing_factor(short, _plan()).forecast >= routing_factor(shape, _plan()).forecast


def test_imbalance_factor_sets_the_factor_and_force_load_balancing_means_balanced():
    given = routing_factor(_shape(moe_imbalance_factor=1.5), _plan())
    assert (given.forecast, given.planning, given.bound, given.basis) == (1.5, 1.5, 4.0, "given")
    capped = routing_factor(_shape(moe_imbalance_factor=9.0), _plan())
    assert capped.forecast == capped.bound == 4.0
    forced = routing_factor(_shape(moe_router_force_load_balancing=True), _plan())
    assert (forced.forecast, forced.planning, forced.basis) == (1.0, 1.0, "balanced")
    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-router-force-load-balancing --disable-bias-linear --gpus 2"
    ).split()
    ns = flags.parse_flags(build_parser(), argv)
    shape, _ = resolve_shape(ns)
    assert shape.moe.moe_router_force_load_balancing
    assert routing_factor(shape, _plan(ep=2)).forecast == 1.0
    assert "--moe-router-force-load-balancing" in flags.flag_names()


@pytest.mark.parametrize("padded", [False, True])
def test_capacity_factor_routing_is_unchanged(padded):
    shape = _shape(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=padded)
    assert routed(shape, "bound") is shape and routed(shape, "planning") is shape
    probe = experts_probe(shape, _plan())
    assert probe is not None and probe.experts.moe_expert_capacity_factor == 1.25
    assert probe.bound == ("exact" if padded else "capacity")


def test_shipped_statistics_state_their_source():
    runs, source = statistics()
    assert "bench/moe_routing.py" in source and "CPU" in source
    with open(STATISTICS) as f:
        data = json.load(f)
    assert len(runs) == len(data["runs"]) >= 3
    for r in data["runs"]:
        assert r["phases"] and r["argv"] and r["spread"] >= 0 and r["overdispersion"] > 0
    assert {r.balancing for r in runs} >= {"aux_loss", "sinkhorn", "none"}


def test_plan_json_carries_forecast_planning_and_bound():
    shape = _shape()
    fixed = ParallelPlan(
        tp=1, pp=2, dp=8, ep=8, micro_batch_size=1, global_batch_size=64, layers_per_stage=(4, 4)
    )
    cluster = Cluster(gpus=16, gpu_memory_bytes=80 * GIB)
    result = plan(shape, cluster, PlanOptions(fixed=fixed), synthetic_source)
    r = result.routing
    assert r is not None
    assert max(r.forecast_peaks) < max(r.planning_peaks) < max(r.bound_peaks)
    assert result.best.rank_peaks == r.forecast_peaks  # the peaks shown are the forecast
    assert result.best.needed == pytest.approx(result.margins.needed(max(r.planning_peaks)))
    data = json.loads(result.to_json())["moe_routing"]
    assert data["forecast_factor"] < data["planning_factor"] < data["bound_factor"] == 4.0
    assert data["bound_peak_bytes"] == list(r.bound_peaks)
    assert any("worst case" in n for n in r.notes())


def test_plan_judges_fits_at_the_planning_factor():
    shape = _shape()
    fixed = ParallelPlan(
        tp=1, pp=2, dp=8, ep=8, micro_batch_size=1, global_batch_size=64, layers_per_stage=(4, 4)
    )
    probe = plan(
        shape,
        Cluster(gpus=16, gpu_memory_bytes=80 * GIB),
        PlanOptions(fixed=fixed),
        synthetic_source,
    )
    r, margins = probe.routing, probe.margins
    assert r is not None
    between = int(
        (margins.needed(max(r.forecast_peaks)) + margins.needed(max(r.planning_peaks))) / 2
    )
    tight = plan(
        shape,
        Cluster(gpus=16, gpu_memory_bytes=between),
        PlanOptions(fixed=fixed),
        synthetic_source,
    )
    assert not tight.best.fits  # the forecast alone would fit; forecast plus margin does not
    space = Space(tp=(1,), pp=(2,), ep=(1, 2, 4, 8), micro_batch_size=(1,), recompute=("none",))
    searched = plan(
        shape,
        Cluster(gpus=16, gpu_memory_bytes=80 * GIB),
        PlanOptions(objective="min-peak", space=space, global_batch_size=64),
        synthetic_source,
    )
    assert searched.routing is not None and searched.best.fits


@pytest.mark.parametrize("memory_gib", [12.0, 80.0])
def test_baselines_are_shown_at_the_forecast_and_judged_at_the_planning_factor(memory_gib):
    """The chosen plan's baselines, as the plans: peaks at the forecast, what they need and whether
    they fit at the planning factor (a baseline judged at the forecast alone was shown fitting and
    faster than a plan that no baseline beat where it was judged: Qwen3-235B-A22B on 256 GPUs);
    and the trade line says which of the two is faster."""
    shape, cluster = _shape(), Cluster(gpus=16, gpu_memory_bytes=int(memory_gib * GIB))
    space = Space(tp=(1,), pp=(2,), ep=(8,), micro_batch_size=(1,), recompute=("none", "full"))
    options = PlanOptions(space=space, global_batch_size=64, context_gib=0)
    result = plan(shape, cluster, options, synthetic_source)
    best, shown = result.best, [b for b in result.baselines if b.partition is not None]
    assert best.fits and shown
    for b in shown:
        assert b.partition is not None
        assert b.needed > result.margins.needed(b.partition.peak)  # not the forecast's need
        assert b.fits == (b.needed <= cluster.gpu_memory_bytes)
        if b.fits:
            assert best.step_seconds <= b.step_seconds * (1 + 1e-9), b.name
        line = next((x for x in result.reasoning if x.startswith(f"{b.name} split (")), "")
        if line and b.step_seconds < best.step_seconds * (1 - 1e-9):
            assert "faster" in line and "slower" not in line, line
