"""--grad-reduce-in-bf16 (Megatron-LM keeps a bf16 run's gradients in fp32 by default): read as a
plan setting, predicted (the gradient buffer halves; the optimizer step holds the fp32 copy of the
gradients it steps, megatron-core's _copy_model_grads_to_main_grads), kept by the search, emitted
in the plan's Megatron flags, and counted by the step-time model's data-parallel traffic."""

from __future__ import annotations

import json

from synthetic_memory import SMALL, SMALL_ARGS, full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.config import DdpOptions, ParallelPlan
from capture_megatron.fit import write_model
from capture_megatron.forecast import layers_for, predict
from capture_megatron.forecast.chunks import chunk_cost
from capture_megatron.rules.flags import UNMODELLED
from capture_megatron.steptime.model import step_time


def _plan(bf16: bool) -> ParallelPlan:
    return ParallelPlan(
        tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8, layers_per_stage=(8, 8),
        distributed_optimizer=True, ddp=DdpOptions(grad_reduce_in_bf16=bf16),
    )  # fmt: skip


def test_bf16_gradients_predicted():
    """Half the gradient bytes on every rank; the step phase gains the fp32 copy of this rank's
    optimizer shard; nothing else moves."""
    model = full_model(SMALL)
    fp32, bf16 = predict(model, SMALL, _plan(False)), predict(model, SMALL, _plan(True))
    for a, b in zip(fp32, bf16):
        assert b.grads * 2 == a.grads and b.params == a.params and b.optimizer == a.optimizer
        assert b.peak < a.peak
    assert (
        step_time(SMALL, _plan(True)).data_parallel < step_time(SMALL, _plan(False)).data_parallel
    )
    copies = [chunk_cost(layers_for(model, SMALL, _plan(b)), SMALL, _plan(b), 0, 0) for b in (0, 1)]
    assert copies[0].step_copies == 0  # fp32 gradients: the optimizer steps a view of them
    assert copies[1].step_copies == copies[1].grads  # one fp32 element per bf16 one of its shard


def test_plan_keeps_and_emits_the_flag(tmp_path, capsys):
    """Given on the command line, every candidate keeps it and megatron_args repeat it."""
    assert "--grad-reduce-in-bf16" not in UNMODELLED
    path = tmp_path / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    out = tmp_path / "plan.json"
    argv = [*SMALL_ARGS, "--memory-model", str(path), "--global-batch-size", "32", "--gpus", "8"]
    argv += ["--gpu-memory-gib", "6", "--context-gib", "0", "--no-progress", "--json", str(out)]
    assert plan_cli.main([*argv, "--grad-reduce-in-bf16"]) == 0
    data = json.loads(out.read_text())
    assert (
        data["plan"]["ddp"]["grad_reduce_in_bf16"]
        and "--grad-reduce-in-bf16" in data["megatron_args"]
    )
    assert plan_cli.main(argv) == 0
    assert not json.loads(out.read_text())["plan"]["ddp"]["grad_reduce_in_bf16"]
    capsys.readouterr()
