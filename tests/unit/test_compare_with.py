"""`plan --compare-with FILE` (issue 51): the plan's estimated step beside another configuration's
for the same model and GPUs, part by part when the plan claims more than 15% over it; the other
line is predicted on the plan's cluster (its own flags win); a file that does not parse or a
configuration that cannot run is refused naming the file."""

from __future__ import annotations

import json

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.errors import CaptureError
from capture_megatron.fit import write_model

CLUSTER = ["--gpus", "8", "--gpu-memory-gib", "40", "--context-gib", "0", "--no-progress"]


@pytest.fixture
def memory_model(tmp_path) -> str:
    path = tmp_path / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    return str(path)


def _plan(memory_model: str, given: str, tmp_path, *extra: str) -> dict:
    line = tmp_path / "given.args"
    line.write_text(given)
    out = tmp_path / "plan.json"
    argv = [*SMALL_ARGS, "--memory-model", memory_model, "--global-batch-size", "32", *CLUSTER]
    assert plan_cli.main([*argv, *extra, "--compare-with", str(line), "--json", str(out)]) == 0
    return json.loads(out.read_text())["compared_with"]


def test_a_slow_configuration_is_shown_part_by_part(memory_model, tmp_path, capsys):
    # full recompute of every layer at TP 8: a configuration the planner would not choose
    slow = " ".join(SMALL_ARGS) + " --global-batch-size 32 --micro-batch-size 1 \\\n"
    slow += "  --tensor-model-parallel-size 8  # NVIDIA's? no: ours, to be outpaced\n"
    slow += "  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1\n"
    got = _plan(memory_model, slow, tmp_path)
    out = capsys.readouterr().out
    assert got["outpaces"] and got["plan_tokens_per_s_per_gpu"] > got["given_tokens_per_s_per_gpu"]
    assert "side by side" in out and "recompute" in out and "given.args" in out
    assert got["given_step"]["recompute"] > 0 == got["plan_step"]["recompute"]
    parts = [v for k, v in got["plan_step"].items() if k != "seconds"]
    assert sum(parts) == pytest.approx(got["plan_step"]["seconds"], rel=1e-6)


def test_the_same_plan_is_not_outpaced(memory_model, tmp_path, capsys):
    out = tmp_path / "first.json"
    argv = [*SMALL_ARGS, "--memory-model", memory_model, "--global-batch-size", "32", *CLUSTER]
    assert plan_cli.main([*argv, "--json", str(out)]) == 0
    # the plan's own flags as the other configuration: the same estimate
    chosen = json.loads(out.read_text())["megatron_args"]
    got = _plan(memory_model, " ".join([*SMALL_ARGS, *chosen]), tmp_path)
    assert not got["outpaces"]
    assert got["given_tokens_per_s_per_gpu"] == pytest.approx(got["plan_tokens_per_s_per_gpu"])
    assert "side by side" not in capsys.readouterr().out


def test_an_unreadable_or_refused_line_names_the_file(memory_model, tmp_path, capsys):
    with pytest.raises(CaptureError, match="given.args: cannot be read"):
        _plan(memory_model, "--num-layers 'unclosed", tmp_path)
    with pytest.raises(CaptureError, match="given.args: .*not divisible by TP 3"):
        _plan(memory_model, " ".join([*SMALL_ARGS, "--tensor-model-parallel-size", "3"]), tmp_path)
