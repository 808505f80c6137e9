"""Mixture-of-experts models train the same function under expert parallelism as one process, and
their checkpoints reshard the experts over another EP.

Real torchrun + gloo + megatron-core's own MoE layers (router, alltoall / allgather token
dispatcher, SequentialMLP experts on the local spec); the same partition-independent initial
weights; real data. Losses and gradient norms must agree to 1e-4 relative (fp32).

To stay within the suite's time budget the cases share runs: the single-process reference trains
6 iterations (the LR schedule is fixed by --lr-decay-iters, so its first 3 are what a 3-iteration
run sees); the EP2 run saves at iteration 3 and is both an equivalence case and the checkpoint
that EP1 resumes from; EP2 x PP2 runs on the mixed dense/MoE model with an uneven layout, the
allgather dispatcher and the distributed optimizer.
"""

from __future__ import annotations

import pytest
from harness import TINY, grad_norms, losses, train, train_single

TOL = 1e-4
MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--disable-bias-linear",
]
MIXED = ["--moe-layer-freq", "([0]*1+[1]*3)"]


def _flags(data_prefix: str, iters: int, *extra: str) -> list[str]:
    tiny = list(TINY)
    tiny[tiny.index("--num-layers") + 1] = "4"
    return [*tiny, "--data-path", data_prefix, "--train-iters", str(iters), *MOE, *extra]


def _check(run, nproc: int, ref_losses: list[float], ref_norms: list[float]) -> None:
    """Same losses and grad norms as the reference; every rank in the memory report; the four
    layers held once per (TP, DP) replica."""
    assert losses(run) == pytest.approx(ref_losses, rel=TOL)
    assert grad_norms(run) == pytest.approx(ref_norms, rel=TOL)
    assert sorted(r.rank for r in run.report.ranks) == list(range(nproc))
    assert all(r.peak_bytes > 0 for r in run.report.ranks)
    held = sorted(
        n for r in run.report.ranks if r.tp_rank == 0 and r.dp_rank == 0 for n in r.layers
    )
    assert held == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def reference(data_prefix, tmp_path_factory):
    """One process (without a launcher): the all-MoE model for 6 iterations, the mixed model
    for 3."""
    work = str(tmp_path_factory.mktemp("moe-reference"))
    moe = train_single(_flags(data_prefix, 6), work, "moe")
    mixed = train_single(_flags(data_prefix, 3, *MIXED), work, "mixed")
    return {
        "moe": (losses(moe), grad_norms(moe)),
        "mixed": (losses(mixed), grad_norms(mixed)),
    }


def test_ep2_matches_and_its_checkpoint_resumes_at_ep1(reference, data_prefix, tmp_path):
    """EP2 (alltoall) equals one process; its checkpoint of iteration 3, loaded by one process
    (EP 1: the experts gathered, the optimizer's chain of two rewritten as one), continues with
    the uninterrupted run's losses."""
    ref_losses, ref_norms = reference["moe"]
    work, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    first = train(
        2,
        _flags(data_prefix, 6, "--expert-model-parallel-size", "2")
        + ["--save", ckpt, "--exit-interval", "3"],
        work,
        "ep2",
    )
    _check(first, 2, ref_losses[:3], ref_norms[:3])
    assert sorted(r.ep_rank for r in first.report.ranks) == [0, 1]
    resumed = train(1, _flags(data_prefix, 6, "--load", ckpt), work, "ep1-resumed")
    assert "resumed from checkpoint iteration 3" in resumed.output
    _check(resumed, 1, ref_losses[3:], ref_norms[3:])


CASES = {
    # name: (nproc, extra flags, reference)
    "ep2_tp2_sp": (
        4,
        [
            "--expert-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        "moe",
    ),
    "mixed_ep2_pp2_layout": (
        4,
        [
            *MIXED,
            "--expert-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-model-parallel-layout",
            "Et|tttL",
            "--use-distributed-optimizer",
            "--moe-token-dispatcher-type",  # the last one given counts (MOE says alltoall)
            "allgather",
        ],
        "mixed",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_plan_matches_single_process(name, reference, data_prefix, tmp_path):
    nproc, extra, ref = CASES[name]
    run = train(nproc, _flags(data_prefix, 3, *extra), str(tmp_path), name)
    ref_losses, ref_norms = reference[ref]
    _check(run, nproc, ref_losses[:3], ref_norms[:3])
    if name.startswith("mixed"):
        by_stage = {r.pp_rank: r.layers for r in run.report.ranks}
        assert by_stage == {0: (1,), 1: (2, 3, 4)}
