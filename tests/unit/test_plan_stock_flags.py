"""Issue 13, item 3: a plan's megatron_args are stock Megatron-LM flags (core_v0.16.1,
flags/megatron_args.json) whenever they can express it. One recompute count for every stage is
--recompute-num-layers; per-stage counts that no single count reproduces are written with
capture-megatron's --recompute-num-layers-per-stage, say so, and come with the best plan stock
Megatron-LM runs. Synthetic memory model, no profiling."""

from __future__ import annotations

import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.cli.render import print_plan
from capture_megatron.config import GIB, Cluster, Kernels, ParallelFlags, ParallelPlan, Recompute
from capture_megatron.flags.megatron_lm import flag_names
from capture_megatron.planner import PlanOptions, plan, plan_args, space_from
from capture_megatron.planner.emit import (
    PER_STAGE_NOTE,
    flag_notes,
    kernel_args,
    stock_recompute_count,
)


def not_stock(args: list[str]) -> list[str]:
    """The flags of `args` stock Megatron-LM's pretrain_gpt.py does not have."""
    return [a for a in args if a.startswith("--") and a not in flag_names()]


def pp_plan(layers: tuple[int, ...], counts: tuple[int, ...], vpp: int = 1) -> ParallelPlan:
    pp = len(counts)
    return ParallelPlan(
        tp=1,
        pp=pp,
        dp=1,
        vpp=vpp,
        micro_batch_size=1,
        global_batch_size=8,
        layers_per_stage=layers,
        recompute=Recompute("full", "block", counts),
    )


@pytest.mark.parametrize(
    "layers, counts, vpp, stock",
    [
        ((4, 4, 4, 4), (2, 2, 2, 2), 1, 2),  # one count everywhere
        ((5, 6, 6, 5), (5, 6, 6, 5), 1, 6),  # every layer of every stage (min-peak)
        ((6, 6, 2), (3, 3, 2), 1, 3),  # 3 of 6, 3 of 6, all 2
        ((0, 8), (0, 2), 1, 2),  # a stage without layers agrees with any count
        ((2, 3, 3, 2), (3, 3), 2, 3),  # chunks (2, 3) and (3, 2): every layer
        ((5, 6, 6, 5), (2, 6, 6, 5), 1, None),  # 2 of 5, but all 6 of the next
        ((6, 6, 6), (3, 6, 0), 1, None),
        ((2, 3, 3, 2), (2, 3), 2, None),  # 2 of rank 0's chunk of 3, all of rank 1's
    ],
)
def test_one_count_when_one_count_recomputes_the_same(layers, counts, vpp, stock):
    plan_ = pp_plan(layers, counts, vpp)
    assert stock_recompute_count(plan_) == stock
    args = plan_args(plan_)
    if stock is None:
        assert args[args.index("--recompute-num-layers-per-stage") + 1] == ",".join(
            map(str, counts)
        )
        assert flag_notes(plan_, Kernels()) == (PER_STAGE_NOTE,)
    else:
        assert args[args.index("--recompute-num-layers") + 1] == str(stock)
        assert not_stock(args) == [] and flag_notes(plan_, Kernels()) == ()


def per_stage_result():
    """Full recompute given without counts, 4 GiB per GPU: the planner's counts differ by stage."""
    flags = ParallelFlags(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=4,
        num_virtual_stages_per_pipeline_rank=1,
        micro_batch_size=1,
        recompute_granularity="full",
    )
    options = PlanOptions(space=space_from(flags), global_batch_size=32, context_gib=0)
    cluster = Cluster(gpus=8, gpu_memory_bytes=4 * GIB)
    return plan(SMALL, cluster, options, synthetic_source)


def test_per_stage_counts_say_so_and_come_with_a_stock_alternative(capsys):
    result = per_stage_result()
    best = result.best.plan
    assert len(set(best.recompute.num_layers)) > 1 and stock_recompute_count(best) is None
    data = result.to_plain()
    assert "--recompute-num-layers-per-stage" in data["megatron_args"]
    assert not_stock(data["megatron_args"]) == ["--recompute-num-layers-per-stage"]
    assert data["megatron_args_notes"] == [PER_STAGE_NOTE]
    alt = data["stock_alternative"]
    assert alt is not None and not_stock(alt["megatron_args"]) == []
    assert "--recompute-num-layers" in alt["megatron_args"] and alt["fits"]
    assert alt["plan"]["recompute"]["granularity"] == "full"
    assert max(alt["predicted_peak_bytes"]) <= result.cluster.gpu_memory_bytes
    assert alt["estimated_step_seconds"] >= data["estimated_step_seconds"]
    print_plan(result)
    out = capsys.readouterr().out
    assert f"  needs: {PER_STAGE_NOTE}" in out
    assert "stock Megatron-LM alternative (" in out


def test_stock_plans_have_no_alternative():
    flags = ParallelFlags(pipeline_model_parallel_size=4, recompute_granularity="full")
    options = PlanOptions(
        objective="min-peak", space=space_from(flags), global_batch_size=32, context_gib=0
    )
    result = plan(SMALL, Cluster(gpus=8, gpu_memory_bytes=80 * GIB), options, synthetic_source)
    data = result.to_plain()
    assert data["stock_alternative"] is None and data["megatron_args_notes"] == []
    assert not_stock(data["megatron_args"]) == []


def test_kernel_flags_are_megatron_lms():
    kernels = Kernels(transformer_impl="auto", cublas_workspace_config=":4096:8")
    args = kernel_args(kernels)
    assert args[:2] == ["--transformer-impl", "transformer_engine"] and not_stock(args) == []
    notes = flag_notes(pp_plan((4, 4), (4, 4)), kernels)
    assert any("CUBLAS_WORKSPACE_CONFIG=:4096:8" in n for n in notes)
    assert any("--transformer-impl auto is written as transformer_engine" in n for n in notes)
