"""Every parallel plan trains the same function as one process.

Real torchrun + gloo + megatron-core; the same partition-independent initial weights; real data.
Losses must agree to 1e-4 relative and gradient norms likewise (bf16: both to 2e-3, the bf16
reduction-order noise measured on this model). Context parallelism (cp*: the all-gather attention of
capture_megatron.emulate.cp_attention) shares the single-process references: learned absolute
positions (position_ids sliced per CP rank) and RoPE + GQA (the rotary table sliced per CP rank),
with TP + SP, and with PP + the distributed optimizer (sharded over DP x CP).
"""

from __future__ import annotations

import pytest
from harness import TINY, grad_norms, losses, train, train_single

ITERS = ["--train-iters", "3"]
FP32_TOL = 1e-4
BF16_TOL = 2e-3

CASES = {
    # name: (nproc, extra flags, reference name)
    "pp4_layout": (
        4,
        [
            "--pipeline-model-parallel-size",
            "4",
            "--pipeline-model-parallel-layout",
            "Et|tt|tt|tttL",
        ],
        "fp32",
    ),
    "pp2_vpp2": (
        2,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
        "fp32",
    ),
    "dp2_distopt": (2, ["--use-distributed-optimizer"], "fp32"),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "fp32"),
    "pp4_stage_recompute": (
        4,
        [
            "--pipeline-model-parallel-size",
            "4",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers-per-stage",
            "2,1,0,0",
        ],
        "fp32",
    ),
    "bf16_tp2_pp2": (
        4,
        ["--bf16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        "bf16",
    ),
    "llama_tp2_pp2": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
        ],
        "llama",
    ),
    # saves at the end too (into the test's directory): the RNG states are replicated over CP
    "cp2": (2, ["--context-parallel-size", "2", "--save", "ckpt", "--save-interval", "3"], "fp32"),
    "llama_cp2_tp2_sp": (
        4,
        [
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        "llama",
    ),
    "llama_cp2_pp2_distopt": (
        4,
        [
            "--context-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
        ],
        "llama",
    ),
}
REFERENCES = {
    "fp32": [],
    "bf16": ["--bf16"],
    "llama": [],
}
LLAMA = [
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]


def _flags(ref: str, data_prefix: str) -> list[str]:
    extra = LLAMA if ref == "llama" else []
    return [*TINY, *ITERS, "--data-path", data_prefix, *extra, *REFERENCES[ref]]


@pytest.fixture(scope="module")
def reference(data_prefix, tmp_path_factory):
    """Single-process runs, one per model variant (without a launcher: a gloo group of one)."""
    out = {}
    work = str(tmp_path_factory.mktemp("reference"))
    for ref in REFERENCES:
        run = train_single(_flags(ref, data_prefix), work, ref)
        out[ref] = (losses(run), grad_norms(run))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_single_process(name, reference, data_prefix, tmp_path):
    nproc, extra, ref = CASES[name]
    run = train(nproc, [*_flags(ref, data_prefix), *extra], str(tmp_path), name)
    ref_losses, ref_norms = reference[ref]
    tol = BF16_TOL if ref == "bf16" else FP32_TOL
    assert losses(run) == pytest.approx(ref_losses, rel=tol)
    assert grad_norms(run) == pytest.approx(ref_norms, rel=tol)
    # the plan really ran: every rank reported, with the layout asked for
    ranks = run.report.ranks
    assert len(ranks) == nproc
    first = [r for r in ranks if r.tp_rank == 0 and r.dp_rank == 0 and r.cp_rank == 0]
    assert sorted(layer for r in first for layer in r.layers) == list(range(1, 9))
    cp = run.report.plan.cp
    assert sorted(r.cp_rank for r in ranks) == sorted(list(range(cp)) * (nproc // cp))
