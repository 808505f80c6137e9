"""What MoE layers retain from a backward until their next forward (issue 16): megatron's token
dispatchers keep the routing tensors of the last pass, whose autograd graph holds the pass's input
leaves and their gradients. Measured by the probes, composed per chunk, carried over the schedule.

- real CPU probes (slow): every chunk of an MoE model under full recompute that the fit did not see
  is predicted exactly (saved bytes, forward from a start that still retains, backward, retained
  bytes and which of them are the input gradient, the dispatchers' routing state: the same per MoE
  layer on every kind); a dense chunk retains nothing and keeps no routing state;
- the composition of mixed dense / MoE chunks equals the one-variant formulas for one variant;
- the bulk peak tables stay bit for bit equal to rank_memory with retention (VPP 1 and 2)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from synthetic_memory import synthetic_source

from capture_megatron.config import ModelShape, ParallelPlan, Recompute
from capture_megatron.features.moe import Experts
from capture_megatron.forecast import layers_for, rank_memory
from capture_megatron.forecast.chunks import _costs, chunk_cost
from capture_megatron.forecast.layers import sizes_for
from capture_megatron.forecast.table import peak_table
from capture_megatron.planner.supply import needs_of

EXPERTS = Experts(
    num_experts=4,
    moe_router_topk=2,
    moe_token_dispatcher_type="alltoall",
    moe_aux_loss_coeff=0.01,
    moe_expert_capacity_factor=1.0,
    moe_pad_expert_input_to_capacity=True,
)
SHAPE = ModelShape(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=512,
    add_bias_linear=False,
    moe=EXPERTS,
)


def _plan(pp: int, vpp: int, rc: Recompute) -> ParallelPlan:
    per = SHAPE.num_layers // (pp * vpp)
    return ParallelPlan(
        tp=1, pp=pp, dp=2, ep=2, vpp=vpp, micro_batch_size=1, global_batch_size=16,
        layers_per_stage=(per,) * (pp * vpp), recompute=rc,
    )  # fmt: skip


class _One:
    """Layers of one fitted variant, for _costs."""

    def __init__(self, vm):
        self.vm = vm

    def model(self, moe: bool):
        return self.vm


@pytest.mark.slow
def test_unfitted_moe_chunks_under_full_recompute_are_exact():
    from capture_megatron.fit import fit, shape_sizes
    from capture_megatron.forecast import variant_of
    from capture_megatron.profile.design import probes_for
    from capture_megatron.profile.probe import Probe
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import ProbeShape

    plan = _plan(2, 1, Recompute("full", "block", (4, 4)))
    variant, shape = variant_of(SHAPE, plan), ProbeShape.of(SHAPE, 1, 2)
    vm = fit(run_probes(probes_for(variant, [shape]), "cpu", progress=False)).variants[0]
    cases = [("middle", 3, 3), ("middle", 4, 2), ("first", 3, 2), ("last", 3, 3), ("only", 3, 1)]
    records = run_probes([Probe(variant, shape, *c) for c in cases], "cpu", progress=False)
    for (kind, k, n), r in zip(cases, records):
        (_, saved, fwd, bwd, _), (ret, grad) = _costs(
            _One(vm), shape_sizes(shape), kind, (True,) * k, n, "block"
        )
        assert r.retained_bytes > 0, (kind, k, n)
        measured = (
            r.saved_bytes + r.retained_bytes,
            r.forward_peak + r.retained_bytes,
            r.backward_peak,
            r.retained_bytes,
            r.retained_grad_bytes,
        )
        assert (saved, fwd, bwd, ret, grad) == measured, (kind, k, n)
        # the dispatchers' routing state: the one-layer probe's per MoE layer, whatever the kind
        state1 = vm.constants(shape_sizes(shape)).chunk(kind).state1
        assert r.routing_state_bytes == k * state1 > 0, (kind, k, n)


@pytest.mark.slow
def test_dense_chunks_retain_nothing():
    """The release forward frees nothing after a dense chunk's backward (which is why only MoE
    probes measure it)."""
    from capture_megatron.config import Kernels
    from capture_megatron.forecast import variant_of
    from capture_megatron.profile.experts import probe_world
    from capture_megatron.profile.groups import fake_job
    from capture_megatron.profile.held import routing_state_bytes
    from capture_megatron.profile.iteration import iteration, release
    from capture_megatron.profile.probe import Probe, build
    from capture_megatron.profile.session import measuring
    from capture_megatron.records import ProbeShape

    dense = dataclasses.replace(SHAPE, moe=Experts())
    plan = dataclasses.replace(_plan(2, 1, Recompute("full", "block", (2, 2))), ep=1)
    variant = variant_of(dense, plan)
    with measuring("cpu", Kernels()) as (setup, meter):
        for kind, k, n in (("middle", 2, 0), ("middle", 2, 1), ("last", 2, 2)):
            probe = Probe(variant, ProbeShape.of(dense, 1, 2), kind, k, n)
            with fake_job(probe.shape.tp, *probe_world(probe)):
                chunk = build(probe, setup)
                iteration(chunk, meter)
                iteration(chunk, meter)
                assert release(chunk, meter) == 0, (kind, k, n)
                assert routing_state_bytes(chunk.model, "cpu") == 0


@pytest.mark.parametrize(
    "pp,vpp,rc",
    [
        (2, 1, Recompute("full", "block", (4, 2))),
        (4, 2, Recompute("full", "block", (1, 1, 1, 1))),
        (2, 2, Recompute("full", "uniform", (1, 1))),
        (4, 1, Recompute("none")),
    ],
)
def test_tables_equal_rank_memory_with_retention(pp, vpp, rc):
    plan = _plan(pp, vpp, rc)
    layers = layers_for(synthetic_source(needs_of(SHAPE, [plan])), SHAPE, plan)
    for rank in range(pp):
        table = peak_table(layers, SHAPE, plan, rank, 4)
        for counts in itertools.product(range(5), repeat=vpp):
            one = rank_memory(layers, SHAPE, plan, rank, counts)
            assert table[counts] == one.peak, (rank, counts)
        retains = sum(chunk_cost(layers, SHAPE, plan, rank, v).retained for v in range(vpp))
        assert retains > 0 or (rc.granularity == "none" and rank == 0)


@pytest.mark.parametrize("kind", ["first", "middle", "last", "only"])
def test_mixed_retention_is_the_one_variant_retention(kind):
    """With every layer an MoE layer the per-layer composition of what a chunk retains is the
    one-variant formula; dense layers add nothing and an all-dense chunk retains nothing."""
    from capture_megatron.forecast.retained import retention

    plan = _plan(2, 1, Recompute("full", "block", (4, 4)))
    layers = layers_for(synthetic_source(needs_of(SHAPE, [plan])), SHAPE, plan)
    sc = layers.model(True).constants(sizes_for(SHAPE, plan))
    c, mid = sc.chunk(kind), sc.chunk("middle")
    further = mid.ret2 - mid.retrc
    for k in range(1, 6):
        for n in range(k + 1):
            want = (
                (c.ret1, c.grad1)
                if n == 0
                else (c.retrc + (n - 1) * further, c.gradrc)
                if n == k
                else (c.retmix + (n - 1) * further, c.gradmix)
            )
            got = retention(lambda m: sc, kind, (True,) * k, n, False)
            assert got == pytest.approx(want), (k, n)
            assert retention(lambda m: sc, kind, (False,) * k, n, False) == (0.0, 0.0)
            if n:
                mixed = (False,) + (True,) * (k - 1)
                assert retention(lambda m: sc, kind, mixed, n, False)[0] <= got[0]
