"""CUDA graphs (--cuda-graph-impl, --cuda-graph-scope; features.cuda_graphs): Megatron-LM's and
megatron-core 0.16.1's rules as one-paragraph refusals, and the static inputs the captured graphs
keep (forecast.cuda_graphs) against the schedule they are captured in. The forecast terms are
checked on the synthetic memory model (tests/unit/synthetic_memory.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import DdpOptions, ParallelPlan
from capture_megatron.config.parallel import Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.features.cuda_graphs import CudaGraphs, static_input_bytes
from capture_megatron.features.moe import Experts
from capture_megatron.forecast import Layers, rank_memory, variant_of
from capture_megatron.forecast.cuda_graphs import graph_buffers
from capture_megatron.forecast.rows import peak_rows
from capture_megatron.forecast.schedule import ScheduleSpec, peak_inflight
from capture_megatron.forecast.table import peak_table
from capture_megatron.records import ProbeShape
from capture_megatron.rules import flags as policy
from capture_megatron.rules.megatron import check_plan_fits_model
from capture_megatron.rules.modelled import ddp_kernel_problem

TE = CudaGraphs(cuda_graph_impl="transformer_engine")
MOE = dataclasses.replace(
    SMALL, moe=Experts(num_experts=8, moe_token_dispatcher_type="alltoall"), num_layers=4
)


def _plan(graphs: CudaGraphs, m: int = 4, **kw) -> ParallelPlan:
    fields = dict(tp=2, pp=1, dp=4, micro_batch_size=1, sequence_parallel=True)
    fields.update(kw)
    pp, vpp = fields["pp"], fields.get("vpp", 1)
    return ParallelPlan(
        global_batch_size=m * fields["micro_batch_size"] * fields["dp"],
        layers_per_stage=(SMALL.num_layers // (pp * vpp),) * (pp * vpp),
        ddp=DdpOptions(cuda_graphs=graphs),
        **fields,
    )


def _layers(plan: ParallelPlan) -> Layers:
    probe = ProbeShape.of(SMALL, plan.tp, plan.micro_batch_size)
    return Layers(synthetic_source(frozenset({(variant_of(SMALL, plan), probe)})).variants[0])


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(cuda_graph_scope=("full", "attn")), "full scope cannot be used"),
        (dict(cuda_graph_scope=("full_iteration",)), "needs --cuda-graph-impl local"),
        (dict(cuda_graph_scope=("moe", "moe_router")), "both moe and moe_router"),
        (dict(cuda_graph_scope=("moe_preprocess",)), "only supported with moe_router"),
        (dict(enable_cuda_graph=True), "Do not use --enable-cuda-graph"),
    ],
)
def test_flag_rules_are_megatrons(settings, words):
    with pytest.raises(CaptureError, match=words):
        CudaGraphs(**{"cuda_graph_impl": "transformer_engine", **settings})


def test_deprecated_switches_and_scopes_as_megatron_reads_them():
    """--enable-cuda-graph means local, --external-cuda-graph transformer_engine; 'full' means
    whole layers; the local impl graphs moe_router and moe_preprocess together."""
    assert CudaGraphs(enable_cuda_graph=True).impl == "local"
    assert CudaGraphs(external_cuda_graph=True).impl == "transformer_engine"
    assert not CudaGraphs().enabled
    assert CudaGraphs(cuda_graph_impl="local", cuda_graph_scope=("full",)).scopes == frozenset()
    local = CudaGraphs(cuda_graph_impl="local", cuda_graph_scope=("moe_preprocess",))
    assert local.scopes == {"moe_router", "moe_preprocess"}
    router = CudaGraphs("transformer_engine", ("moe_router",))
    assert router.graphs_layer(True) and not router.graphs_layer(False)
    assert not router.graphs_attention() and TE.graphs_attention()
    iteration = CudaGraphs("local", ("full_iteration",))
    assert not iteration.graphs_layer(True)


def test_the_flags_are_modelled():
    for name in ("--cuda-graph-impl", "--cuda-graph-scope", "--cuda-graph-warmup-steps"):
        assert policy.unmodelled_reason(name) is None
    assert policy.ignored("--decode-only-cuda-graphs")  # inference only


@pytest.mark.parametrize(
    "shape, graphs, plan_kw, words",
    [
        (MOE, CudaGraphs("transformer_engine", ("mlp",)), {}, "every layer is an MoE layer"),
        (MOE, CudaGraphs("transformer_engine", ("moe",)), {}, "drop-and-pad"),
        (SMALL, CudaGraphs("transformer_engine", ("moe_router",)), {}, "needs MoE layers"),
        (MOE, CudaGraphs("local"), dict(ep=2), "moe-pad-experts-for-cuda-graph-inference"),
        (SMALL, TE, dict(recompute=Recompute("full", num_layers=(1,))), "full_iteration"),
    ],
)
def test_model_rules_are_refusals(shape, graphs, plan_kw, words):
    plan = _plan(graphs, **plan_kw)
    with pytest.raises(CaptureError, match=words):
        check_plan_fits_model(shape, plan)


def test_cpu_kernel_set_refuses_them():
    ddp = DdpOptions(cuda_graphs=TE)
    assert "--device fake" in ddp_kernel_problem(ddp, "cpu", False)
    assert ddp_kernel_problem(ddp, "gpu", False) == ""


def test_static_inputs_as_get_layer_static_inputs_makes_them():
    """bf16 hidden states [s/CP (/TP with SP), b, h]; with attention a bool mask [b, 1, s/CP, s]."""
    assert static_input_bytes(4096, 2, 1024, 4, 2, True, False) == 2 * 512 * 2 * 1024
    assert static_input_bytes(4096, 2, 1024, 4, 2, False, True) == (
        2 * 2048 * 2 * 1024 + 2 * 2048 * 4096
    )


def test_pp1_captures_one_micro_batch_of_every_layer():
    """Without pipelining TECudaGraphHelper captures one micro-batch: every graphed layer keeps
    one set of static inputs, plus one gradient-output buffer and the rotary table."""
    plan = _plan(TE)
    s, b, h, t = SMALL.seq_length, 1, SMALL.hidden_size, 2
    one = static_input_bytes(s, b, h, t, 1, True, True)
    grad = s // t * b * h * 2
    rotary = 4 * s * SMALL.head_dim if SMALL.position_embedding_type == "rope" else 0
    chunks = [(False,) * SMALL.num_layers]
    assert graph_buffers(SMALL, plan, 0, chunks) == SMALL.num_layers * one + grad + rotary
    assert graph_buffers(SMALL, _plan(CudaGraphs()), 0, chunks) == 0.0


@pytest.mark.parametrize("pp,vpp", [(2, 1), (4, 1), (2, 2)])
def test_pipelines_keep_the_forwards_in_flight(pp, vpp):
    """With PP every micro-batch of the step is captured in the schedule's order; a backward
    frees its forward's static inputs for reuse, so a rank keeps those of its forwards in flight
    (1F1B rank r: min(pp - r, m) micro-batches of its layers)."""
    plan = _plan(TE, m=8, pp=pp, dp=8 // pp, vpp=vpp)
    s, h = SMALL.seq_length, SMALL.hidden_size
    one = static_input_bytes(s, 1, h, 2, 1, True, True)
    rope = SMALL.position_embedding_type == "rope"
    extra = s // 2 * h * 2 + (4 * s * SMALL.head_dim if rope else 0)
    plain = _plan(CudaGraphs(), m=8, pp=pp, dp=8 // pp, vpp=vpp)
    layers = _layers(plain)
    for rank in range(pp):
        chunks = [(False,) * n for n in plan.chunks_of(rank)]
        got = graph_buffers(SMALL, plan, rank, chunks)
        if vpp == 1:
            slots = peak_inflight(ScheduleSpec(pp, 8), rank) * plan.chunks_of(rank)[0]
            assert got == slots * one + extra
        before = rank_memory(layers, SMALL, plain, rank)
        after = rank_memory(layers, SMALL, plan, rank)
        assert after.other - before.other == got > 0
        assert after.peak - before.peak == pytest.approx(got)
        table = peak_table(layers, SMALL, plan, rank, 4)
        splits = [(1,) * vpp, (4,) * vpp, (2, 3)[:vpp]]
        rows = peak_rows(layers, SMALL, plan, rank, np.array(splits))
        assert rows is not None
        for counts, row in zip(splits, rows):
            assert table[counts] == rank_memory(layers, SMALL, plan, rank, counts=counts).peak
            assert row == pytest.approx(table[counts], rel=1e-12)
