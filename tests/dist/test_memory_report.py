"""The memory report shows the 1F1B pattern (real torchrun, gloo, 4
ranks)."""

from __future__ import annotations

from harness import TINY, train


def test_uniform_pp4_first_stage_holds_most(tmp_path):
    args = [
        *TINY,
        "--train-iters",
        "2",
        "--mock-data",
        "--pipeline-model-parallel-size",
        "4",
        "--seq-length",
        "128",
        "--max-position-embeddings",
        "128",
    ]
    run = train(4, args, str(tmp_path), "pp4")
    assert run.returncode == 0, run.output[-3000:]
    rep = run.report
    assert (
        rep.device == "cpu"
        and rep.plan.num_microbatches == 8
        and rep.plan.layout == "Ett|tt|tt|ttL"
    )
    peaks = rep.stage_peaks()
    assert peaks[0] > peaks[1] > peaks[2], peaks  # 4 / 3 / 2 micro-batches in flight
    assert peaks[0] > peaks[3]
    assert [r.layers for r in sorted(rep.ranks, key=lambda r: r.pp_rank)] == [
        (1, 2),
        (3, 4),
        (5, 6),
        (7, 8),
    ]
    assert all(r.peak_bytes > r.setup_bytes > 0 for r in rep.ranks)
    assert len(rep.iterations) == 2 and all(it.step_seconds > 0 for it in rep.iterations)
