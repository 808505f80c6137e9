"""The throughput search's twin searches side by side (issue 53): forked one per CPU where the
memory model needs no profiling, with the results of running them one after the other; a fork
that would profile gives its search back to the parent, which profiles it."""

from __future__ import annotations

import os

import pytest
from synthetic_memory import SMALL, full_model, synthetic_source

from capture_megatron.config import GIB, Cluster
from capture_megatron.planner import PlanOptions, PlanResult, plan, sidebyside
from capture_megatron.planner.space import Space
from capture_megatron.planner.supply import Supply, Unrecorded

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")


def _pid() -> int:
    return os.getpid()


def test_jobs_run_in_forks_in_order_and_here_below_the_work_worth_it(monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_WORKERS", "2")
    jobs = [_pid, lambda: 7, _pid]
    forked = sidebyside.side_by_side(jobs, sidebyside.MIN_WORK)
    assert forked[1] == 7 and os.getpid() not in (forked[0], forked[2])
    here = sidebyside.side_by_side(jobs, sidebyside.MIN_WORK - 1)
    assert here == [os.getpid(), 7, os.getpid()]
    monkeypatch.setenv("CAPTURE_MEGATRON_WORKERS", "1")  # one CPU: nothing to gain
    assert sidebyside.side_by_side(jobs, sidebyside.MIN_WORK)[0] == os.getpid()


def test_on_fork_runs_once_in_each_child_only(monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_WORKERS", "2")
    seen: list[int] = []
    out = sidebyside.side_by_side(
        [lambda: len(seen)] * 2, sidebyside.MIN_WORK, lambda: seen.append(1)
    )
    assert out == [1, 1] and seen == []


def _plan(memory, gib: int) -> PlanResult:
    """SMALL on 8 GPUs of `gib` GiB, global batch 128, throughput with optimizer offload and
    ZeRO-3 searched: the offloading twins' search and the ZeRO-3 twins' are two jobs."""
    options = PlanOptions(
        context_gib=0.0,
        global_batch_size=128,
        space=Space(optimizer_offload=(0.0, 0.5, 1.0)),
    )
    return plan(SMALL, Cluster(gpus=8, gpu_memory_bytes=gib * GIB, device="cuda"), options, memory)


@pytest.mark.parametrize(
    ("memory", "gib"),
    [
        ("model", 4),
        pytest.param("model", 3, marks=pytest.mark.slow),
        pytest.param("source", 4, marks=pytest.mark.slow),
        pytest.param("source", 3, marks=pytest.mark.slow),
    ],
)
def test_side_by_side_plans_are_those_searched_one_after_the_other(monkeypatch, memory, gib):
    """Forced to fork (no work floor, two CPUs): the same ranking, steps and peaks as one process
    gives, with a complete memory model (the forks profile nothing) and with a source that
    records nothing (each fork gives its search back: the parent profiles it). At 4 GiB the
    offloading twins do not beat the plan without offload (the ZeRO-3 search's mark stands); at
    3 GiB one does, so the ZeRO-3 twins are searched again with its mark."""
    given = full_model(SMALL) if memory == "model" else synthetic_source
    monkeypatch.setenv("CAPTURE_MEGATRON_WORKERS", "1")
    alone = _plan(given, gib)
    monkeypatch.setenv("CAPTURE_MEGATRON_WORKERS", "2")
    monkeypatch.setattr(sidebyside, "MIN_WORK", 0)
    forked = _plan(given, gib)
    assert [(e.plan, e.step_seconds, e.peak) for e in forked.ranked] == [
        (e.plan, e.step_seconds, e.peak) for e in alone.ranked
    ]
    assert forked.considered == alone.considered


def test_an_offline_supply_profiles_nothing():
    supply = Supply(SMALL, synthetic_source)
    supply.go_offline()
    from capture_megatron.config import ParallelPlan

    p = ParallelPlan(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=32,
                     layers_per_stage=(SMALL.num_layers,))  # fmt: skip
    with pytest.raises(Unrecorded):
        supply.model_for([p])
    assert not supply.have


def test_a_search_that_would_profile_in_a_fork_comes_back_empty():
    """_recorded: an offline Supply's search that needs a pair not recorded gives None (the
    parent then searches it, profiling)."""
    from capture_megatron.config import ParallelPlan
    from capture_megatron.planner.search import _recorded

    supply = Supply(SMALL, synthetic_source)
    supply.go_offline()
    p = ParallelPlan(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=32,
                     layers_per_stage=(SMALL.num_layers,))  # fmt: skip

    def run(plans, beaten):
        supply.model_for(plans)
        raise AssertionError("profiled offline")

    assert _recorded(supply, run, [p], 1.0) is None


def test_the_parents_signal_handlers_stay_out_of_the_forks(monkeypatch, capfd):
    """The pool ends its forks with SIGTERM once their jobs are done; a handler the parent
    installed (the CLI's raises) must not run there: no traceback on the user's terminal."""
    import signal

    def stop(signum, frame):
        raise RuntimeError(f"stopped by {signum}")

    monkeypatch.setenv("CAPTURE_MEGATRON_WORKERS", "2")
    saved = signal.signal(signal.SIGTERM, stop)
    try:
        assert sidebyside.side_by_side([lambda: 1, lambda: 2], sidebyside.MIN_WORK) == [1, 2]
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert "Traceback" not in capfd.readouterr().err
