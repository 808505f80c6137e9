"""Issue 28, Must show 4: a CPU plan runs as predicted. `capture-megatron plan --device cpu` writes
its JSON; its model_args plus megatron_args, given as they are to `capture-megatron train` (real
torchrun, gloo, 4 ranks), train the plan the JSON describes (the trainer's report holds the same
parallel plan), and every pipeline rank's measured peak is within 2% of the plan's forecast (the
CPU kernel set is validated to that: tests/dist/test_verify.py). Held-out style configs of this
test's own: a GQA / RMSNorm / SwiGLU model searched (the throughput objective; TP and micro-batch
given to keep the cold CPU profile short), and a
LayerNorm GPT with full recompute asked for and interleaving fixed."""

from __future__ import annotations

import json

import pytest
from harness import cli

pytestmark = pytest.mark.dist

BASE = [
    "--hidden-size", "96", "--num-attention-heads", "6", "--seq-length", "96",
    "--max-position-embeddings", "96", "--vocab-size", "700", "--global-batch-size", "16",
]  # fmt: skip
CONFIGS = {
    "gqa-swiglu-searched": [
        "--num-layers", "10", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--tensor-model-parallel-size", "1", "--micro-batch-size", "2",  # CI time: PP, DP,
    ],  # layout and recompute searched
    "gpt-full-recompute-interleaved": [
        "--num-layers", "12", "--pipeline-model-parallel-size", "2",
        "--num-virtual-stages-per-pipeline-rank", "2", "--recompute-granularity", "full",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpu_plan_trains_as_predicted(name, tmp_path):
    plan_json = tmp_path / "plan.json"
    planned = cli(
        ["plan", *BASE, *CONFIGS[name], "--device", "cpu", "--gpus", "4", "--gpu-memory-gib", "8",
         "--no-progress", "--json", str(plan_json)],
        timeout=900, cwd=str(tmp_path),
    )  # fmt: skip
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    result = json.loads(plan_json.read_text())
    args = result["model_args"] + result["megatron_args"]
    assert args[args.index("--transformer-impl") + 1] == "local"
    report = tmp_path / "report.json"
    trained = cli(
        ["train", "--nproc", "4", *args, "--mock-data", "--train-iters", "2", "--no-progress",
         "--memory-report", str(report)],
        timeout=900, cwd=str(tmp_path),
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    measured = json.loads(report.read_text())
    section = result["plan"]
    ran = measured["plan"]
    for key in ("tp", "pp", "dp", "vpp", "micro_batch_size", "global_batch_size"):
        assert ran[key] == section[key], key
    assert tuple(ran["layers_per_stage"]) == tuple(section["layers_per_stage"])
    assert ran["recompute"] == section["recompute"]
    peaks = [0] * section["pp"]
    for rank in measured["ranks"]:
        peaks[rank["pp_rank"]] = max(peaks[rank["pp_rank"]], rank["peak_bytes"])
    for got, want in zip(peaks, result["predicted_peak_bytes"]):
        assert abs(got - want) <= 0.02 * got, (name, peaks, result["predicted_peak_bytes"])
    print(
        f"{name}: {section['layout']} measured {peaks} predicted {result['predicted_peak_bytes']}"
    )
