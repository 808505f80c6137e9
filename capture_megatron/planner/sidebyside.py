"""Independent searches run side by side, one per core (pure Python).

The throughput search's twin searches (capture_megatron.planner.search: the optimizer and
activation offloading twins, fraction by fraction, and Megatron-FSDP's ZeRO-3 twins) do not
depend on each other once the fastest plan without them is known, and each splits hundreds of
candidates (planner.timed: tens of seconds for a 70B model). side_by_side runs them in forked
processes, one per CPU this process may use ($CAPTURE_MEGATRON_WORKERS overrides, as for the
profiling workers). A fork profiles nothing (it would write the records file beside its
siblings): the caller's `on_fork` takes its Supply offline, and a search that needs profiling
comes back empty, to be run again by the parent (planner.search._recorded). The
children inherit the searches (closures: nothing is pickled on the way in) and send back only
their SearchResults, so the results are those of running the searches one after the other, in
the same order.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

T = TypeVar("T")

MIN_WORK = 2000
"""Fewest candidates (over all the searches) worth forking for: a fork and its result's trip back
cost tens of milliseconds, a search of a few hundred candidates about as much."""

_JOBS: Sequence[Callable[[], object]] = ()
"""The searches of the side_by_side call under way (what its forked children run)."""


def _cpus() -> int:
    given = os.environ.get("CAPTURE_MEGATRON_WORKERS", "")
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


_ON_FORK: list[Callable[[], None]] = []
"""What a forked child runs before its jobs (the side_by_side call's `on_fork`)."""


def _forked() -> None:
    # the parent's handlers are not the child's: the pool ends its children with SIGTERM when a
    # job fails (the CLI's handler would raise there), and a Ctrl-C is the parent's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for hook in _ON_FORK:
        hook()


def _run(i: int) -> object:
    return _JOBS[i]()


def side_by_side(
    jobs: Sequence[Callable[[], T]], work: int, on_fork: Callable[[], None] = lambda: None
) -> list[T]:
    """The jobs' results, in order: in forked processes (each running `on_fork` once, first)
    where this machine has more than one CPU, fork exists (and this process may have children:
    not a daemon), there are two jobs or more and `work` (their candidates) is at least
    MIN_WORK; else one after the other here."""
    global _JOBS
    workers = min(len(jobs), _cpus())
    forks = "fork" in multiprocessing.get_all_start_methods()
    forks = forks and not multiprocessing.current_process().daemon  # a daemon has no children
    if workers < 2 or not forks or work < MIN_WORK:
        return [job() for job in jobs]
    _JOBS = jobs
    _ON_FORK[:] = [on_fork]
    try:
        with warnings.catch_warnings():
            # a progress bar's monitor thread: the children run none of it, only their search
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            pool = multiprocessing.get_context("fork").Pool(workers, _forked)
        try:
            results = pool.map(_run, range(len(jobs)), chunksize=1)
        except BaseException:
            pool.terminate()
            pool.join()
            raise
        # the children end on the queue's sentinels, not on SIGTERM: one still starting holds
        # the handler it inherited until `_forked` runs, and a SIGTERM it swallowed there left it
        # waiting on the queue for good (seen once in CI: Pool.terminate joining it forever)
        pool.close()
        pool.join()
        return cast(list[T], results)
    finally:
        _JOBS = ()
        _ON_FORK.clear()
