"""--overlap-moe-expert-parallel-comm (issue 26): megatron-core 0.16.1's combined 1F1B schedule
at PP 1 in the forecast (forecast.overlap), Megatron's rules for it as one-paragraph
refusals, --delay-wgrad-compute's queued weight-gradient inputs, and what is still refused (the
CPU kernel set). The
forecast terms are checked against the fitted constants they are derived from (synthetic memory
model: the constants come from the shape, not from a fit)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import DdpOptions, ParallelPlan
from capture_megatron.config.parallel import Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.features.moe import Experts
from capture_megatron.forecast import Layers, rank_memory, sizes_for, variant_of
from capture_megatron.forecast.overlap import merged
from capture_megatron.forecast.schedule import ScheduleSpec, events, warmup_count
from capture_megatron.forecast.table import peak_table
from capture_megatron.records import ProbeShape
from capture_megatron.rules import flags as policy
from capture_megatron.rules.megatron import check_plan_fits_model
from capture_megatron.rules.modelled import ddp_kernel_problem

FLAG = "--overlap-moe-expert-parallel-comm"
MOE = dataclasses.replace(
    SMALL, moe=Experts(num_experts=8, moe_token_dispatcher_type="alltoall"), num_layers=4
)


def _plan(overlap: bool, m: int = 4, **kw) -> ParallelPlan:
    fields = dict(tp=2, pp=1, dp=4, ep=4, micro_batch_size=1, sequence_parallel=True)
    fields.update(kw)
    pp, vpp = fields["pp"], fields.get("vpp", 1)
    return ParallelPlan(
        global_batch_size=m * fields["micro_batch_size"] * fields["dp"],
        layers_per_stage=(16 // (pp * vpp),) * (pp * vpp),
        ddp=DdpOptions(overlap_moe_expert_parallel_comm=overlap),
        **fields,
    )


def _layers(plan: ParallelPlan) -> Layers:
    probe = ProbeShape.of(SMALL, plan.tp, plan.micro_batch_size)
    return Layers(synthetic_source(frozenset({(variant_of(SMALL, plan), probe)})).variants[0])


def test_merged_steps_add_the_overlapped_micro_batch():
    """PP 1: the forward holds the previous micro-batch's embedding gradient besides; the
    backward is the worse of its head (with the next micro-batch's embedding output) and a merged
    layer step (the head's saved bytes freed, one layer's saved bytes and peak on top)."""
    plain, over = _plan(False), _plan(True)
    layers = _layers(plain)
    sc = layers.main.constants(sizes_for(SMALL, plain))
    mid, only = sc.chunk("middle"), sc.chunk("only")
    m = merged(layers, SMALL, over, ("only",))
    assert m.hidden == mid.input_bytes > 0
    assert m.layer_step == max(sc.layer_saved + mid.bwd1, mid.fwd1)
    assert m.head("only") == only.saved_ends - sc.chunk("first").saved_ends > 0
    assert m.head("middle") == 0.0
    before, after = rank_memory(layers, SMALL, plain, 0), rank_memory(layers, SMALL, over, 0)
    assert (after.params, after.grads, after.optimizer, after.other) == (
        before.params,
        before.grads,
        before.optimizer,
        before.other,
    )
    # the merged moments only ever add: at least the hidden state, at most it plus the layer step
    assert before.peak + m.hidden <= after.peak
    assert after.peak <= before.peak + m.hidden + max(m.layer_step - m.head("only"), 0.0)


def test_one_micro_batch_runs_no_merged_step():
    """With one micro-batch the combined schedule runs its forward alone, then its backward."""
    plain, over = _plan(False, m=1), _plan(True, m=1)
    layers = _layers(plain)
    assert [e.merged for e in events(ScheduleSpec(1, 1, overlap=True), 0)] == [False, False]
    assert rank_memory(layers, SMALL, over, 0) == rank_memory(layers, SMALL, plain, 0)


def test_pp1_merges_each_forward_with_the_previous_backward():
    """combined_1f1b_schedule_for_no_pipelining: micro-batch 0's forward alone, then (i's
    forward, i-1's backward) for i = 1 .. m-1, then the last backward alone."""
    order = events(ScheduleSpec(1, 4, overlap=True), 0)
    got = [(e.kind, e.microbatch, e.merged) for e in order]
    pairs = [x for i in range(1, 4) for x in (("F", i, True), ("B", i - 1, False))]
    assert got == [("F", 0, False), *pairs, ("B", 3, False)]


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 2), (4, 2)])
def test_the_partitioner_table_equals_rank_memory(pp, vpp):
    over = _plan(True, m=8, pp=pp, dp=8 // pp, vpp=vpp, ep=2)
    layers = _layers(over)
    for rank in range(pp):
        table = peak_table(layers, SMALL, over, rank, 5)
        for counts in ((1,) * vpp, (5,) * vpp, (2, 3)[:vpp], (0, 4)[:vpp]):
            expect = rank_memory(layers, SMALL, over, rank, counts=counts).peak
            assert table[counts] == expect, (pp, vpp, rank, counts)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (2, 6, 3), (4, 8, 2), (4, 4, 2), (3, 6, 2)])
def test_interleaved_warmup_has_one_more_forward_as_megatron(p, m, v):
    """megatron-core's get_pp_rank_microbatches with overlap_moe_expert_parallel_comm=True
    (schedules.py:775-778), read through a fake process group as pipeline rank r."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for rank in range(p):
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p)
        try:
            ps.initialize_model_parallel(1, p, v, create_gloo_process_groups=False)
            for over in (False, True):
                warm = get_pp_rank_microbatches(m, v, p, overlap_moe_expert_parallel_comm=over)[2]
                spec = ScheduleSpec(p, m, v, overlap=over)
                assert warmup_count(spec, rank) == warm, (p, m, v, rank, over)
        finally:
            ps.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    spec = ScheduleSpec(p, m, v, overlap=True)
    order = events(spec, 0)
    merged_at = [i for i, e in enumerate(order) if e.merged]
    assert all(order[i + 1].kind == "B" for i in merged_at)
    assert len(merged_at) == m * v - warmup_count(spec, 0)


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (dict(ep=1), "needs expert parallelism, EP > 1"),
        (dict(dispatcher="allgather"), "needs --moe-token-dispatcher-type alltoall or flex"),
        (dict(dtype="fp32"), "needs --bf16 or --fp16"),
        (dict(full=True), "does not allow full recomputation"),
        (dict(mtp=1), "allows one MTP layer, and only with PP > 1"),
    ],
)
def test_megatron_rules_are_refusals(change, rule):
    """megatron-core's TransformerConfig asserts these (transformer_config.py:1852-1906)."""
    shape = MOE
    if "dispatcher" in change:
        shape = dataclasses.replace(shape, moe=Experts(num_experts=8))
    if "dtype" in change:
        shape = dataclasses.replace(shape, dtype="fp32")
    if "mtp" in change:
        shape = dataclasses.replace(shape, mtp_num_layers=1)
    kw = dict(ep=change.get("ep", 4))
    if change.get("full"):
        kw["recompute"] = Recompute("full", "block", (1,))
    plan = dataclasses.replace(_plan(True, **kw), layers_per_stage=(4,))
    if "mtp" in change:
        plan = dataclasses.replace(plan, mtp_layers=1)
    check_plan_fits_model(shape, dataclasses.replace(plan, ddp=DdpOptions()))  # fine without
    with pytest.raises(CaptureError, match=rule) as err:
        check_plan_fits_model(shape, plan)
    assert FLAG in str(err.value) and "\n" not in str(err.value)


def test_pipeline_parallelism_needs_virtual_stages():
    with pytest.raises(CaptureError, match="needs virtual pipeline stages"):
        _plan(True, pp=2, dp=2, ep=2)
    assert _plan(True, pp=2, dp=2, vpp=2, ep=2).ddp.overlap_moe_expert_parallel_comm


def test_an_mtp_layer_is_one_more_layer_node_of_the_last_chunk():
    """With one MTP layer (PP > 1, as megatron requires) the plan is accepted; the last chunk's
    head freed before the layer steps leaves out the MTP layer's saved bytes (one layer's `S`),
    and a merged step with the last chunk runs a layer step even without decoder layers."""
    from capture_megatron.forecast.chunks import chunk_cost
    from capture_megatron.forecast.overlap import merged_peak

    shape = dataclasses.replace(MOE, mtp_num_layers=1)
    plan = dataclasses.replace(_plan(True, pp=2, dp=2, vpp=2, ep=2), mtp_layers=1)
    plan = dataclasses.replace(plan, layers_per_stage=(1, 1, 2, 0))
    check_plan_fits_model(shape, plan)
    probe = ProbeShape.of(shape, plan.tp, plan.micro_batch_size)
    layers = Layers(synthetic_source(frozenset({(variant_of(shape, plan), probe)})).variants[0])
    sc = layers.main.constants(sizes_for(shape, plan))
    m = merged(layers, shape, plan, ("middle", "last"))
    assert m.head("last") == max(sc.chunk("last").saved_ends - sc.layer_saved, 0.0)
    assert (m.nodes("last", "middle"), m.nodes("middle", "middle"), m.nodes("last", "last")) == (
        1,
        0,
        2,
    )
    last = chunk_cost(layers, shape, plan, 1, 1)  # the MTP-only chunk
    assert last.layers == 0 and last.kind == "last"
    step = m.hidden - m.head("last") + m.layer_step
    assert merged_peak(m, last, last, 0.0) >= step > 0
    assert all(r.peak > 0 for r in (rank_memory(layers, shape, plan, p) for p in (0, 1)))


def test_delay_wgrad_compute_holds_each_nodes_queued_inputs():
    """--delay-wgrad-compute: modelled (a DdpOptions flag); every layer backward, merged or not,
    holds the larger of its nodes' queued weight-gradient inputs
    (features.delay_wgrad: at TP 2 with SP the attention's gathered rows s x b; the experts'
    rows the rank's tokens s x b / TP x expert TP x top-2 at the routing factor)."""
    from capture_megatron.forecast.routing import routing_factor
    from capture_megatron.forecast.wgrad import layer_hold, wgrad_hold

    assert policy.unmodelled_reason("--delay-wgrad-compute") is None
    over = _plan(True)
    delayed = dataclasses.replace(
        over, ddp=DdpOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    )
    factor = routing_factor(MOE, over).forecast
    h, s, d = MOE.hidden_size, MOE.seq_length, MOE.head_dim
    heads, groups, etp = MOE.num_attention_heads, MOE.groups, over.expert_tp
    qkv, proj, f = (heads + 2 * groups) * d // 2, heads * d // 2, MOE.moe_ffn // etp
    rows = round(s // 2 * etp * 2 * factor)
    up = (2 if MOE.gated else 1) * f
    want = layer_hold(MOE, delayed, True, factor)
    assert want.attention == 2 * (s * (h + qkv) + s * (proj + h))
    assert want.mlp == 2 * (rows * (h + up) + rows * (f + h))
    assert wgrad_hold(MOE, delayed, (True, True)) == want.peak > 0
    assert wgrad_hold(MOE, over, (True,)) == 0.0
    layers = _layers(over)
    sc = layers.main.constants(sizes_for(MOE, over))
    mid = sc.chunk("middle")
    m = merged(layers, MOE, delayed, ("only",))
    assert m.layer_step == max(sc.layer_saved + mid.bwd1 + want.peak, mid.fwd1)
    before, after = rank_memory(layers, MOE, over, 0), rank_memory(layers, MOE, delayed, 0)
    assert before.peak <= after.peak <= before.peak + want.peak


def test_delay_wgrad_compute_follows_megatrons_rules():
    """It needs the overlap (megatron-core's TransformerConfig) and Transformer Engine
    (Megatron-LM's arguments.py)."""
    alone = dataclasses.replace(_plan(False), ddp=DdpOptions(delay_wgrad_compute=True))
    with pytest.raises(CaptureError, match="needs --overlap-moe-expert-parallel-comm"):
        check_plan_fits_model(MOE, alone)
    from capture_megatron.config import Kernels
    from capture_megatron.rules.modelled import check_request

    ddp = DdpOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    local = Kernels(transformer_impl="local")
    with pytest.raises(CaptureError, match="only supported with transformer_engine"):
        check_request(MOE, local, ddp, (1,), "", None, "")
    check_request(MOE, Kernels(), ddp, (1,), "", None, "")


def test_cpu_kernel_set_refuses_it():
    """The combined schedule needs a CUDA communication stream and events."""
    ddp = DdpOptions(overlap_moe_expert_parallel_comm=True)
    assert "--device fake" in ddp_kernel_problem(ddp, "cpu", False)
    assert ddp_kernel_problem(ddp, "gpu", False) == ""


def test_the_planner_searches_only_what_megatron_runs():
    """With the overlap `plan` searches EP > 1, no full recompute and, at PP > 1, virtual
    stages only (megatron-core's rules); without it all of them."""
    from capture_megatron.config import GIB, Cluster
    from capture_megatron.planner import Space
    from capture_megatron.planner.space import candidates

    gpu = Cluster(gpus=8, gpu_memory_bytes=80 * GIB)
    plain = list(candidates(MOE, gpu, 64, Space()))
    over = list(
        candidates(MOE, gpu, 64, Space(ddp=DdpOptions(overlap_moe_expert_parallel_comm=True)))
    )
    assert over and len(over) < len(plain)
    assert min(p.ep for p in plain) == 1 and min(p.ep for p in over) > 1
    assert "full" in {p.recompute.granularity for p in plain}
    assert "full" not in {p.recompute.granularity for p in over}
    assert {p.vpp for p in over if p.pp > 1} and all(p.vpp > 1 for p in over if p.pp > 1)
