"""CPU ranks forked from a preloaded torchrun (train.preloaded: how `capture-megatron train`,
`verify` and `demo` start ranks on a machine without CUDA, and how these tests start theirs) train
and measure exactly what ranks started as Pythons of their own do (torchrun's usual `-m` start,
which GPU machines and the Slurm scripts keep)."""

from __future__ import annotations

from harness import TINY, grad_norms, losses, train

PLAN = [
    *("--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"),
    *("--recompute-granularity", "selective", "--train-iters", "3"),
]


def test_forked_ranks_train_and_measure_what_started_ranks_do(data_prefix, tmp_path):
    args = [*TINY, *PLAN, "--data-path", data_prefix]
    forked = train(2, args, str(tmp_path), "forked")
    started = train(2, args, str(tmp_path), "started", fork=False)
    assert losses(forked) == losses(started)
    assert grad_norms(forked) == grad_norms(started)
    assert forked.report is not None and started.report is not None
    assert forked.report.ranks == started.report.ranks  # every rank's measured peak and setup
    assert "Traceback" not in forked.output
