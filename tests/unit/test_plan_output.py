"""Issue 13, items 2 and 6: what `capture-megatron plan` prints and writes. The default objective
is throughput (and says so); the plan comes with its reasons; the table has no duplicate rows and
one legend; a CPU run counts processes, rounds its memory and shows no step time. Runs the real
command line in-process on a synthetic memory model (--memory-model, no profiling)."""

from __future__ import annotations

import json

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model, synthetic_source

from capture_megatron.cli import plan as plan_cli
from capture_megatron.config import GIB, Cluster
from capture_megatron.fit import write_model
from capture_megatron.planner import PlanOptions, plan


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    return str(path)


def run(model_file: str, tmp_path, capsys, *extra: str) -> tuple[list[str], dict]:
    """`plan` of the small model on the synthetic model: (printed lines, the plan JSON)."""
    out = tmp_path / "plan.json"
    argv = [*SMALL_ARGS, "--memory-model", model_file, "--global-batch-size", "32"]
    argv += ["--context-gib", "0", "--no-progress", "--json", str(out), *extra]
    assert plan_cli.main(argv) == 0
    return capsys.readouterr().out.splitlines(), json.loads(out.read_text())


def table(lines: list[str]) -> list[str]:
    """The rows of the top-plans table."""
    start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["TP", "PP"])
    end = next(i for i, ln in enumerate(lines) if ln.strip().startswith("peak: "))
    return lines[start + 1 : end]


def test_default_objective_is_throughput(model_file, tmp_path, capsys):
    assert PlanOptions().objective == "throughput"
    help_text = " ".join(plan_cli.build_parser().format_help().split())
    assert "throughput, the default: the fastest estimated step among plans that fit" in help_text
    gpus = ["--gpus", "8", "--gpu-memory-gib", "6"]
    lines, default = run(model_file, tmp_path, capsys, *gpus)
    _, fastest = run(model_file, tmp_path, capsys, *gpus, "--objective", "throughput")
    _, lowest = run(model_file, tmp_path, capsys, *gpus, "--objective", "min-peak")
    assert default["plan"] == fastest["plan"] != lowest["plan"]
    assert default["estimated_step_seconds"] <= lowest["estimated_step_seconds"]
    assert max(lowest["predicted_peak_bytes"]) <= max(default["predicted_peak_bytes"])
    assert default["reasoning"][0].startswith("the fastest estimated step")
    assert "objective throughput" in default["reasoning"][0]
    assert lowest["reasoning"][0].startswith("the lowest predicted worst-rank peak")
    why = next(ln for ln in lines if ln.startswith("why: "))
    assert why == "why: " + default["reasoning"][0]


def test_reasons_name_what_the_simpler_setups_need(model_file, tmp_path, capsys):
    lines, data = run(model_file, tmp_path, capsys, "--gpus", "8", "--gpu-memory-gib", "3")
    plain = next(r for r in data["reasoning"] if r.startswith("plain data parallelism"))
    assert "(TP 1, PP 1, DP 8," in plain and "> 3 GiB" in plain, plain
    assert data["plan"]["tp"] * data["plan"]["pp"] > 1  # why it is not plain data parallelism
    assert any(f"  {plain}" == ln for ln in lines)


def test_top_plans_are_distinct(model_file, tmp_path, capsys):
    """With memory to spare full recompute is trimmed to none: that candidate and the one without
    recompute are the same plan, listed once."""
    lines, _ = run(model_file, tmp_path, capsys, "--gpus", "8", "--gpu-memory-gib", "40")
    rows = table(lines)
    assert len(rows) == len(set(rows)) > 1, rows
    cluster = Cluster(gpus=8, gpu_memory_bytes=40 * GIB)
    result = plan(SMALL, cluster, PlanOptions(global_batch_size=32), synthetic_source)
    assert len({e.plan for e in result.ranked}) == len(result.ranked)
    assert "none" in {e.plan.recompute.granularity for e in result.ranked}


def test_every_column_is_explained_once(model_file, tmp_path, capsys):
    lines, _ = run(model_file, tmp_path, capsys, "--gpus", "8", "--gpu-memory-gib", "6")
    text = "\n".join(lines)
    assert text.count("peak: predicted peak of allocated memory on the worst pipeline rank") == 1
    assert "need = peak + allocator reserve (2%) + CUDA context and NCCL (0 GiB)" in text
    assert "fits: need <= 6 GiB" in text and text.count("step s: ") == 1
    for column in ("SP sequence parallel", "DO distributed optimizer", "VPP virtual stages"):
        assert text.count(column) == 1, column
    assert text.count("in flight: micro-batches alive per chunk at the peak") == 1


def test_cpu_runs_count_processes_and_show_no_step_time(model_file, tmp_path, capsys):
    cpu = ["--device", "cpu", "--gpus", "2", "--gpu-memory-gib", "23.5406"]
    lines, data = run(model_file, tmp_path, capsys, *cpu)
    assert " on 2 processes of 23.5 GiB " in lines[0], lines[0]
    assert "GPUs" not in lines[0]
    assert {row.split()[11] for row in table(lines)} == {"-"}  # the step s column
    assert data["estimated_step_seconds"] is None
    assert "step s: not estimated for CPU processes" in "\n".join(lines)
    assert "need = peak (CPU processes: no allocator reserve or CUDA context)" in "\n".join(lines)
