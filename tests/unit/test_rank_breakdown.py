"""Issue 13, item 6: a rank's breakdown at its peak attributes what the layers hold to activations,
consistently with the micro-batches in flight and the layers held: the running forward's saved
tensors and, with full recompute, the layers its backward recomputes are activations, not
transient -- and the parts still add up to the same peak. Synthetic memory model, no
profiling."""

from __future__ import annotations

import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import ParallelPlan, Recompute
from capture_megatron.forecast import Layers, chunk_cost, rank_memory, variant_of
from capture_megatron.records import ProbeShape

PARTS = ("params", "grads", "optimizer", "activations", "transient", "other")


def stages_plan(recompute: Recompute, layers=(4, 4, 4, 4)) -> ParallelPlan:
    return ParallelPlan(
        tp=2,
        pp=len(layers),
        dp=1,
        micro_batch_size=1,
        global_batch_size=16,
        layers_per_stage=layers,
        recompute=recompute,
        sequence_parallel=True,
    )


def fits_of(plan: ParallelPlan) -> Layers:
    probe = ProbeShape.of(SMALL, plan.tp, plan.micro_batch_size)
    return Layers(synthetic_source(frozenset({(variant_of(SMALL, plan), probe)})).variants[0])


PLANS = {
    "no recompute": stages_plan(Recompute()),
    "every layer recomputed": stages_plan(Recompute("full", "block", (4, 4, 4, 4))),
    "some layers recomputed": stages_plan(Recompute("full", "block", (2, 1, 0, 3))),
    "uniform groups of 2": stages_plan(Recompute("full", "uniform", (2, 2, 2, 2))),
    "13 layers on the last stage": stages_plan(Recompute(), layers=(1, 1, 1, 13)),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_activations_follow_the_micro_batches_and_layers_held(name):
    plan = PLANS[name]
    vm = fits_of(plan)
    for r in range(plan.pp):
        s = rank_memory(vm, SMALL, plan, r)
        assert sum(getattr(s, k) for k in PARTS) == pytest.approx(s.peak, rel=1e-12)
        cost = chunk_cost(vm, SMALL, plan, r, 0)
        held = sum(n * chunk_cost(vm, SMALL, plan, r, v).inflight for v, n in enumerate(s.inflight))
        running = s.activations - held
        assert s.activations > 0 and s.transient >= 0
        if s.phase == "forward":  # the running micro-batch: its input and saved tensors
            assert running == pytest.approx(cost.inflight, rel=1e-9)
        elif s.phase == "backward":  # counted alive; plus what its recompute re-creates
            assert running == pytest.approx(cost.recomputed, rel=1e-9)
            if plan.recompute.layers_on(r) == 0:
                assert cost.recomputed == 0
            if plan.recompute.layers_on(r) >= cost.layers:  # every layer: one is redone
                assert cost.recomputed > 0


def test_a_forward_peak_holds_the_running_micro_batch_as_activations():
    """The reproducer: the last stage of 1F1B has no micro-batch alive before each forward, so its
    whole forward used to be reported as transient beside activations of 0."""
    plan = PLANS["13 layers on the last stage"]
    vm = fits_of(plan)
    last = rank_memory(vm, SMALL, plan, plan.pp - 1)
    assert last.phase == "forward" and last.inflight == (0,)
    cost = chunk_cost(vm, SMALL, plan, plan.pp - 1, 0)
    saved = cost.inflight - cost.input_bytes
    assert last.activations == pytest.approx(cost.inflight)  # 13 layers' saved + the input
    assert saved > 12 * vm.main.layer_saved.predict(fits_sizes(plan))
    # the rest: the forward's temporaries and the input gradient the schedule may still hold
    assert cost.forward - saved <= last.transient <= cost.forward - saved + cost.input_bytes
    assert last.transient < last.activations


def fits_sizes(plan: ParallelPlan):
    from capture_megatron.forecast import sizes_for

    return sizes_for(SMALL, plan)
