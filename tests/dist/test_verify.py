"""`verify` on the CPU — the plan's predicted peaks are within 2% of the measured
ones on every rank, and the planned layout's measured worst rank is below Megatron's uniform split
at identical settings (real torchrun, gloo, 4 ranks; each config trains the plan and the uniform
split)."""

from __future__ import annotations

import json

import pytest
from harness import cli, train

MODEL = [
    "--num-layers",
    "8",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--vocab-size",
    "512",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
]
LLAMA = [
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
PP4 = ["--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "1"]
PP2TP2 = [
    "--pipeline-model-parallel-size",
    "2",
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
]
PP2DP2 = [
    "--pipeline-model-parallel-size",
    "2",
    "--tensor-model-parallel-size",
    "1",
    "--use-distributed-optimizer",
]
SELECTIVE = ["--recompute-granularity", "selective"]
NONE = ["--recompute-granularity", "none"]
NOVPP = ["--num-virtual-stages-per-pipeline-rank", "1"]
CONFIGS = {
    # name: (flags the plan fixes, flags of Megatron's uniform split at the same settings)
    "pp2_tp2_sp_selective": ([*PP2TP2, *SELECTIVE, *NOVPP], [*PP2TP2, *SELECTIVE]),
    "pp2_dp2_distopt": ([*PP2DP2, *NONE, *NOVPP], PP2DP2),
    "pp4_vpp2_selective": (
        [*PP4, *SELECTIVE, "--num-virtual-stages-per-pipeline-rank", "2"],
        [*PP4, *SELECTIVE, "--num-virtual-stages-per-pipeline-rank", "2"],
    ),
    "pp4_per_stage_full": (
        [*PP4, "--recompute-granularity", "full", *NOVPP],
        [
            *PP4,
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "2",
        ],
    ),
    "pp4_llama_bf16_selective": (
        [*PP4, *LLAMA, "--bf16", *SELECTIVE, *NOVPP],
        [*PP4, *LLAMA, "--bf16", *SELECTIVE],
    ),
    # bf16 gradient buffers, and the fp32 copy of the shard the distributed optimizer steps
    "pp2_dp2_distopt_bf16_grads": (
        [*PP2DP2, *LLAMA, "--bf16", "--grad-reduce-in-bf16", *NONE, *NOVPP],
        [*PP2DP2, *LLAMA, "--bf16", "--grad-reduce-in-bf16"],
    ),
}


def verify(flags: list[str], tmp_path) -> dict:
    """`verify` of the model with these flags on 4 CPU ranks (2 iterations); its JSON result. The
    plan is the lowest-peak one (--objective min-peak): these tests compare the memory-balanced
    layout with Megatron's uniform split at the same recompute (the default objective,
    throughput, would recompute the fewest layers the host's memory allows)."""
    out = tmp_path / "verify.json"
    run = ["--nproc", "4", "--device", "cpu", "--mock-data", "--train-iters", "2"]
    run += ["--objective", "min-peak"]
    temp = tmp_path / "tmp"  # verify's own temporary files go here, and must be gone after
    temp.mkdir(exist_ok=True)
    done = cli(
        ["verify", *MODEL, *flags, *run, "--no-progress", "--json", str(out)],
        timeout=600,
        cwd=str(tmp_path),
        env={"TMPDIR": str(temp)},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # torch keeps one compile cache per user there (torchinductor_<user>, reused by every run)
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]
    assert not left, f"verify left temporary files behind: {left}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_predicts_within_2_percent_and_beats_uniform(name, tmp_path):
    plan_flags, uniform_flags = CONFIGS[name]
    result = verify([*plan_flags, "--keep", str(tmp_path)], tmp_path)
    assert result["max_abs_error"] <= 0.02
    balanced = max(r["measured_bytes"] for r in result["ranks"])
    run = train(
        4,
        [*MODEL, *uniform_flags, "--mock-data", "--train-iters", "2", "--no-progress"],
        str(tmp_path),
        "uniform",
    )
    assert run.returncode == 0, run.output[-3000:]
    uniform = max(run.report.stage_peaks())
    print(
        f"{name}: layout {result['plan']['layout']} worst {balanced / 2**20:.2f} MiB vs uniform "
        f"{run.report.plan.layout} {uniform / 2**20:.2f} MiB: "
        f"{100 * (1 - balanced / uniform):.1f}% lower; "
        f"max prediction error {100 * result['max_abs_error']:.2f}%"
    )
    assert balanced < uniform


@pytest.mark.parametrize("group", [2])
def test_uniform_recompute_is_kept_and_predicted_within_2_percent(group, tmp_path):
    """`--recompute-method uniform --recompute-num-layers n` recomputes every layer, n at a time:
    the plan keeps it as given and its forecast is within 2% of what the 4 ranks measure."""
    uniform = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    result = verify([*PP4, *NOVPP, *uniform, "--recompute-num-layers", str(group)], tmp_path)
    recompute = result["plan"]["recompute"]
    assert (recompute["granularity"], recompute["method"]) == ("full", "uniform")
    assert set(recompute["num_layers"]) == {group}
    print(f"uniform n={group}: max prediction error {100 * result['max_abs_error']:.2f}%")
    assert result["max_abs_error"] <= 0.02
