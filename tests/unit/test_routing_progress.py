"""Routing of a run whose routers hardly train (issue 51): a pasted command line's --train-iters
and learning-rate schedule give the learning rate summed over its iterations; up to the shipped
initial_lr_sum, the dropless forecast takes the statistics measured with routers as initialised
(bench/moe_routing.py --at-init, GPT-2 BPE tokens), their spread grown as the early steps
measured it at that sum, else -- and for every plan, whose length is not given -- the trained
statistics."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.api.request import resolve_shape, with_router_lr
from capture_megatron.cli.predict import build_parser
from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.features.moe import Experts
from capture_megatron.fields import flagged_fields
from capture_megatron.flags import parser as flags
from capture_megatron.forecast import routing
from capture_megatron.forecast.support import experts_probe

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 1024 "
    "--max-position-embeddings 1024 --vocab-size 256 --num-experts 8 --moe-router-topk 2 "
    "--disable-bias-linear --expert-model-parallel-size 8 --gpus 8"
)
"""A dropless MoE line with one expert per EP rank, no load balancing (Megatron-LM's default
coefficient 0), as Megatron-LM's EP 8 functional tests route."""
FUNCTIONAL_SCHEDULE = (
    "--train-iters 100 --lr 0.00015 --lr-decay-iters 320000 --lr-warmup-fraction .01"
)
"""Megatron-LM's GPT functional tests' schedule: 100 iterations of a 3,200-iteration warm-up."""


def _shape(extra: str = "") -> ModelShape:
    ns = flags.parse_flags(build_parser(), f"{BASE} {extra}".split())
    shape, _ = resolve_shape(ns)
    return with_router_lr(shape, ns)


def _plan() -> ParallelPlan:
    return ParallelPlan(
        tp=1, pp=1, dp=8, ep=8, micro_batch_size=4, global_batch_size=32, layers_per_stage=(2,)
    )


def test_the_learning_rate_summed_as_megatron_schedules_it():
    """Iteration i steps at lr (i - 1) / warm-up during the warm-up, then at most lr."""
    assert routing.lr_sum(1.5e-4, 3200, 100) == pytest.approx(1.5e-4 * 99 * 100 / 2 / 3200)
    assert routing.lr_sum(1e-3, 0, 10) == pytest.approx(1e-2)
    assert routing.lr_sum(1e-3, 4, 10) == pytest.approx(1e-3 * (0 + 0.25 + 0.5 + 0.75 + 6))


def test_a_run_within_its_warm_up_routes_as_initialised():
    """The functional tests' schedule sums to 2.3e-4: the statistics of routers as initialised,
    a smaller factor than the trained routers' without balancing, and said so."""
    early, long = _shape(FUNCTIONAL_SCHEDULE), _shape()
    assert early.moe.router_lr_sum == pytest.approx(2.32e-4, rel=0.01)
    assert long.moe.router_lr_sum is None  # no --train-iters: a plan of unknown length
    f_early, f_long = routing.routing_factor(early, _plan()), routing.routing_factor(long, _plan())
    assert "as initialised" in f_early.source and "as initialised" not in f_long.source
    assert 1.0 < f_early.forecast < f_long.forecast <= f_long.bound
    probe = experts_probe(early, _plan())  # the probe's key does not carry the run's length
    assert probe is not None and probe.experts.router_lr_sum is None


def test_a_run_that_trains_its_routers_keeps_the_trained_statistics():
    """10,000 iterations at 1.5e-4 after a 100-iteration warm-up sum far above the threshold."""
    trained = _shape("--train-iters 10000 --lr 0.00015 --lr-warmup-iters 100")
    assert trained.moe.router_lr_sum > routing.initial_lr_sum()
    f = routing.routing_factor(trained, _plan())
    assert f.source == routing.routing_factor(_shape(), _plan()).source


def test_the_spread_grows_along_the_measured_early_steps():
    """No growth before the first step; the largest so far after, interpolated between steps;
    the curve without balancing reaches the trained routers' spread at initial_lr_sum."""
    assert routing.drift("none", 0.0) == 1.0
    a, b = routing.drift("none", 1e-4), routing.drift("none", 1e-3)
    assert 1.0 <= a <= b and b > 1.5
    trained = {r.name: r for r in routing.statistics()[0]}["e8k2-none"].spread
    first = {r.num_experts: r for r in routing.initial_statistics()}[8].spread
    limit = routing.initial_lr_sum()
    assert first * routing.drift("none", limit) == pytest.approx(trained, rel=0.05)


def test_the_shipped_initial_runs_cover_the_measured_expert_counts():
    runs = routing.initial_statistics()
    assert {(r.num_experts, r.topk) for r in runs} >= {(8, 2), (32, 4), (128, 8)}
    assert all(r.balancing == "initial" and r.spread > 0 for r in runs)


def test_experts_keep_the_field_out_of_flags():
    names = {f.name for f, _ in flagged_fields(Experts)}
    assert "router_lr_sum" not in names
    assert dataclasses.replace(Experts(), router_lr_sum=1e-4).router_lr_sum == 1e-4
