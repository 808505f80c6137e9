"""Issue 31, Build 3: fine-grained activation offloading's module sets as a plan dimension. min-gpus
and throughput try them on the GPU kernel set with Transformer Engine where they beat recompute
(throughput: only where the plan without them does not fit); min-peak (which only reports the peak
they reach), CPU processes and --no-activation-offload leave them out; the output names what the
chosen offload saves and costs; a memory model whose records do not say what offloading moves is
planned without it. On the synthetic memory model with synthetic offload rows (no profiling): these
check the planner's logic, not a forecast (tests/unit/test_act_offload.py checks that)."""

from __future__ import annotations

import dataclasses

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, synthetic_source

from capture_megatron.cli import plan as plan_cli
from capture_megatron.config import GIB, Cluster, DdpOptions, Kernels, ParallelPlan, Recompute
from capture_megatron.features.activation_offload import (
    OFFLOAD_SETS,
    ActivationOffload,
    OffloadTensor,
)
from capture_megatron.fit import MemoryModel, Needs
from capture_megatron.flags import parser as flags
from capture_megatron.planner import PlanOptions, Space, plan
from capture_megatron.planner.offload_space import activation_rank, activation_sets
from capture_megatron.planner.search import undominated


def _rows(z) -> tuple[OffloadTensor, ...]:
    """Synthetic offload rows of one layer: a hidden state per norm and QKV input, four for the
    attention core (query, key, value, output), one for the projection."""
    hidden = 2 * z.b * z.s * z.h // z.t
    parts = (("attn_norm", 1), ("qkv_linear", 1), ("core_attn", 4), ("attn_proj", 1))
    return tuple(OffloadTensor(g, k * hidden // 2, k * hidden) for g, k in parts) + (
        OffloadTensor("mlp_norm", hidden // 2, hidden),
    )


def offload_source(needs: Needs) -> MemoryModel:
    """synthetic_source whose records say what each group would offload, standing for a model
    of Transformer Engine's layers (which megatron-core's offloading needs)."""
    m = synthetic_source(needs)
    return dataclasses.replace(
        m,
        kernels="gpu:transformer_engine/auto",
        variants=tuple(
            dataclasses.replace(
                vm,
                anchors=tuple(
                    dataclasses.replace(a, layer_offload=_rows(a.sizes)) for a in vm.anchors
                ),
            )
            for vm in m.variants
        ),
    )


def _plan(gib: float, objective: str, source=offload_source, gpus: int = 8, **kw):
    """plan() of SMALL on `gpus` GPUs of `gib` (global batch 32, no CUDA context margin, the
    optimizer kept on the device)."""
    options = PlanOptions(
        objective=objective,
        context_gib=0.0,
        global_batch_size=32,
        space=Space(optimizer_offload=(0.0,)),
        **kw,
    )
    cluster = Cluster(gpus=gpus, gpu_memory_bytes=int(gib * GIB))
    return plan(SMALL, cluster, options, source)


def _groups(e) -> tuple[str, ...]:
    """What a plan offloads of its activations (an Evaluated, or a PlanResult's best)."""
    e = getattr(e, "best", e)
    return e.plan.ddp.activation_offload.groups


@pytest.mark.parametrize("objective", ["throughput", "min-gpus"])
def test_offload_replaces_full_recompute_where_it_is_faster(objective):
    """On 8 GPUs of 2.5 GiB every plan without offload recomputes whole layers; offloading the
    attention core's activations fits with selective recompute only, and is the faster step."""
    without = _plan(2.5, objective, no_activation_offload=True).best
    best = _plan(2.5, objective)
    assert without.plan.recompute.granularity == "full" and not _groups(without)
    assert _groups(best) in OFFLOAD_SETS and best.best.plan.recompute.granularity != "full"
    assert best.best.fits and best.best.step_seconds < without.step_seconds
    # the flags Megatron-LM reads
    args = best.megatron_args()
    assert "--fine-grained-activation-offloading" in args
    modules = args[args.index("--offload-modules") + 1 :][: len(_groups(best))]
    assert tuple(modules) == _groups(best)
    # the trade, named
    line = next(r for r in best.reasoning if "offloads the activations" in r)
    assert "--no-activation-offload" in line and "host memory per node" in line
    assert "without it the same plan needs" in line  # it does not fit without


def test_throughput_keeps_a_plan_that_fits_without_it():
    """With memory to spare the plan is the one found without offload (offload only adds
    transfers)."""
    found = _plan(6.0, "throughput")
    assert found.best.plan == _plan(6.0, "throughput", source=synthetic_source).best.plan
    assert not _groups(found)


def test_min_peak_cpu_and_the_switch_leave_it_out():
    """min-peak, a CPU cluster and --no-activation-offload search no activation offload."""
    assert not _groups(_plan(2.5, "min-peak"))
    assert not _groups(_plan(2.5, "throughput", no_activation_offload=True))
    te = Space().ddp
    assert activation_sets(SMALL, te, "min-peak", "gpu:transformer_engine", _kernels()) == ((),)
    assert activation_sets(SMALL, te, "throughput", "cpu", _kernels()) == ((),)
    assert activation_sets(SMALL, te, "throughput", "gpu:local", _kernels()) == ((),)
    # a dense model: no experts' set
    assert activation_sets(SMALL, te, "min-gpus", "gpu:transformer_engine", _kernels()) == (
        (),
        *OFFLOAD_SETS[:-1],
    )
    ns = flags.parse_flags(plan_cli.build_parser(), [*SMALL_ARGS, "--no-activation-offload"])
    assert ns.no_activation_offload


def test_min_peak_reports_the_lowest_device_peak_offload_reaches():
    """min-peak does not offload unless asked, but its reasoning names the lowest device peak the
    chosen sizes reach with offload: the optimizer's, then whether offloading the activations
    instead of recomputing lowers it further (here it does not: the MLP keeps its own); not
    where the records do not say what offloading moves, nor with --no-activation-offload."""
    found = _plan(2.5, "min-peak")
    line = next(r for r in found.reasoning if "with all of its optimizer offloaded" in r)
    assert f"offloading the activations of {', '.join(OFFLOAD_SETS[1])}" in line
    assert "instead of recomputing would not lower it" in line
    assert "the lowest device peak these sizes reach" in line
    for other in (
        _plan(2.5, "min-peak", source=synthetic_source),
        _plan(2.5, "min-peak", no_activation_offload=True),
    ):
        line = next(r for r in other.reasoning if "with all of its optimizer offloaded" in r)
        assert "activations" not in line


def _kernels() -> Kernels:
    return Kernels()


def test_offload_given_on_the_command_line_is_kept():
    """A set given (--fine-grained-activation-offloading) is every candidate's, not searched."""
    given = ActivationOffload.of(("core_attn",))
    options = PlanOptions(
        objective="throughput",
        context_gib=0.0,
        global_batch_size=32,
        space=Space(optimizer_offload=(0.0,), ddp=DdpOptions(activation_offload=given)),
    )
    result = plan(SMALL, Cluster(gpus=8, gpu_memory_bytes=int(3 * GIB)), options, offload_source)
    assert _groups(result) == ("core_attn",)


def test_records_without_the_measurement_plan_without_it():
    """synthetic_source's records do not say what offloading moves: planned as before."""
    assert not _groups(_plan(2.5, "throughput", source=synthetic_source))
    assert not _groups(_plan(2.5, "min-gpus", source=synthetic_source))


def test_more_offload_is_lighter_but_not_than_full_recompute():
    """min-peak's dominance: a twin offloading a larger set needs no more memory; full recompute
    and offload are not compared (a dense layer's MLP keeps its activations under offload)."""
    base = ParallelPlan(
        tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=32, layers_per_stage=(8, 8)
    )
    full = dataclasses.replace(base, recompute=Recompute("full", "block", (8, 8)))
    moved = [
        dataclasses.replace(base, ddp=DdpOptions(activation_offload=ActivationOffload.of(s)))
        for s in OFFLOAD_SETS[:2]
    ]
    assert [activation_rank(p.ddp) for p in (base, *moved)] == [0, 1, 2]
    kept = undominated([base, full, *moved])
    assert kept == [full, moved[1]]


@pytest.mark.parametrize(
    "gib", [pytest.param(g, marks=pytest.mark.slow) for g in (2.5, 3.0, 4.0)]
)  # the exhaustive check costs 10-45 s a cap: the full suite runs it
def test_the_search_finds_the_fastest_of_every_offloading_candidate(gib):
    """Throughput's bounds and pruning (a plan whose twin offloading more activations does not fit
    on the device is not split) lose nothing: the plan found is as fast as the fastest of every
    candidate of the searched space, offloading or not, each split alone."""
    from capture_megatron.planner.fastest import fastest
    from capture_megatron.planner.offload_space import fsdp_twin
    from capture_megatron.planner.run import searched_options
    from capture_megatron.planner.search import FSDP_MARGIN
    from capture_megatron.planner.space import candidates
    from capture_megatron.planner.supply import Supply

    found = _plan(gib, "throughput").best
    cluster = Cluster(gpus=8, gpu_memory_bytes=int(gib * GIB))
    given = PlanOptions(
        context_gib=0.0, global_batch_size=32, space=Space(optimizer_offload=(0.0,))
    )
    options = searched_options(given, cluster, SMALL)
    assert len(options.space.activation_offload) == 3  # none, attention, layer
    supply, margins = Supply(SMALL, offload_source), options.margins(cluster, SMALL.hidden_size)
    plain = list(candidates(SMALL, cluster, 32, options.space))
    zero3 = [t for t in map(fsdp_twin, plain) if t is not None]  # Megatron-FSDP's twins too
    assert zero3 and True in options.space.fsdp

    def fastest_of(plans):
        return min(
            (
                e.step_seconds
                for p in plans
                for e in fastest(
                    supply, SMALL, cluster, [p], margins, options.cost, 1, False
                ).ranked
                if e.fits
            ),
            default=float("inf"),
        )

    best = fastest_of(plain)
    assert best < float("inf") and found.step_seconds <= best * (1 + 1e-9), (found, best)
    best_zero3 = fastest_of(zero3)  # taken only where FSDP_MARGIN ahead
    if best_zero3 < best * (1 - FSDP_MARGIN):
        assert found.step_seconds <= best_zero3 * (1 + 1e-9), (found, best_zero3)
