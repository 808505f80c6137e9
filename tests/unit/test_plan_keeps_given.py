"""Issue 12, must-show 6 and issue 13, item 1: `plan` keeps what it was given, or refuses it with a
reason. The layer implementation, attention backend, recompute method and counts and every fixed
size appear in its JSON and in its `megatron_args` as given (profiled on the GPU kernel set, fake
CUDA; and, without profiling, on a synthetic memory model)."""

from __future__ import annotations

import json
import re

import pytest
from synthetic_memory import SMALL, synthetic_source
from test_cli_errors import cli

from capture_megatron.config import GIB, Cluster, ParallelFlags, Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.planner import PlanOptions, plan, plan_args, space_from
from capture_megatron.planner.space import candidates

MODEL = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --vocab-size 512 --bf16 --hidden-dropout 0 --attention-dropout 0"
)
GIVEN = {
    "--transformer-impl": "local",
    "--attention-backend": "unfused",
    "--tensor-model-parallel-size": "2",
    "--pipeline-model-parallel-size": "2",
    "--micro-batch-size": "2",
    "--recompute-granularity": "full",
    "--recompute-method": "uniform",
    "--recompute-num-layers": "2",
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_plan_keeps_kernels_recompute_and_sizes(impl, tmp_path):
    given = dict(GIVEN, **{"--transformer-impl": impl})
    out = tmp_path / "plan.json"
    argv = ["plan", *MODEL.split(), *(x for kv in given.items() for x in kv), "--sequence-parallel"]
    argv += ["--gpus", "8", "--gpu-memory-gib", "80", "--device", "fake-cuda", "--no-progress"]
    done = cli([*argv, "--json", str(out)], str(tmp_path), CAPTURE_MEGATRON_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    args = data["megatron_args"]
    for flag, value in given.items():
        assert args[args.index(flag) + 1] == value, (flag, args)
    assert args.count("--sequence-parallel") == 1
    plan = data["plan"]
    assert (plan["tp"], plan["pp"], plan["micro_batch_size"]) == (2, 2, 2)
    rc = {"granularity": "full", "method": "uniform", "num_layers": [2, 2], "modules": []}
    assert plan["recompute"] == rc
    kernels = data["kernels"]
    assert (kernels["transformer_impl"], kernels["attention_backend"]) == (impl, "unfused")
    assert data["memory_model"]["kernels"].startswith("gpu:")


# The same promise without profiling (a synthetic memory model, tests/unit/synthetic_memory.py):
# every size and setting given reaches the plan, or is refused with a reason.


def plan_given(objective: str = "throughput", memory_gib: float = 80, **given):
    """plan() of the small model on 8 GPUs with these ParallelFlags fixed."""
    space = space_from(ParallelFlags(**given))
    cluster = Cluster(gpus=8, gpu_memory_bytes=int(memory_gib * GIB))
    options = PlanOptions(objective=objective, space=space, global_batch_size=32, context_gib=0)
    return plan(SMALL, cluster, options, synthetic_source)


@pytest.mark.parametrize("objective", ["throughput", "min-peak"])
def test_given_sizes_and_uniform_recompute_are_kept(objective):
    best = plan_given(
        objective,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2,
        micro_batch_size=2,
        sequence_parallel=True,
        use_distributed_optimizer=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=2,
    ).best.plan
    assert (best.tp, best.pp, best.vpp, best.micro_batch_size) == (2, 2, 2, 2)
    assert best.sequence_parallel and best.distributed_optimizer
    assert best.recompute == Recompute("full", "uniform", (2, 2))
    args = plan_args(best)
    assert args[args.index("--recompute-method") + 1] == "uniform"
    assert args[args.index("--recompute-num-layers") + 1] == "2"


def test_given_per_stage_counts_and_selective_are_kept():
    counts = plan_given(
        pipeline_model_parallel_size=4,
        recompute_granularity="full",
        recompute_num_layers_per_stage="3,1,0,2",
    ).best.plan.recompute
    assert counts == Recompute("full", "block", (3, 1, 0, 2))
    selective = plan_given(recompute_granularity="selective", pipeline_model_parallel_size=2)
    assert {e.plan.recompute.granularity for e in selective.ranked} == {"selective"}


@pytest.mark.parametrize("objective", ["throughput", "min-peak"])
def test_given_full_recompute_stays_full_where_none_would_fit(objective):
    """Without counts the planner chooses them, but never zero everywhere: that would replace the
    full recompute asked for by none."""
    result = plan_given(objective, memory_gib=80, recompute_granularity="full")
    for e in result.ranked:
        assert e.plan.recompute.granularity == "full"
        counts = e.plan.recompute.num_layers
        assert all(n >= 1 for r, n in enumerate(counts) if e.plan.layers_of(r)), e.plan


@pytest.mark.parametrize(
    "given, named",
    [
        ({"recompute_num_layers": 2}, "--recompute-num-layers 2: only full recompute"),
        ({"recompute_method": "block"}, "--recompute-method block: only full recompute"),
        (
            {"recompute_granularity": "full", "recompute_method": "uniform"},
            "--recompute-method uniform needs --recompute-num-layers",
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers_per_stage": "1,1",
            },
            "--recompute-num-layers-per-stage needs --recompute-method block",
        ),
    ],
)
def test_recompute_flags_that_cannot_be_kept_are_refused(given, named):
    with pytest.raises(CaptureError, match=re.escape(named)):
        space_from(ParallelFlags(**given))


def test_given_context_parallel_size_is_kept_in_every_candidate():
    """CP is a size of the search: a given one is fixed, and DP is what TP x CP x PP leave."""
    space = space_from(ParallelFlags(context_parallel_size=2, tensor_model_parallel_size=2))
    assert space.cp == (2,)
    found = list(candidates(SMALL, Cluster(gpus=16, gpu_memory_bytes=80 * GIB), 32, space))
    assert found and all(p.cp == 2 and p.tp * p.cp * p.pp * p.dp == 16 for p in found)
    assert {p.pp for p in found} >= {1, 2, 4}
