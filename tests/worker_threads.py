"""How many CPU threads a test process's kernels get (tests/conftest.py sets it up; a module of its
own so that tests can import it: each test folder has a conftest of its own)."""

import os


def threads_per_worker() -> int:
    """CPU threads for each pytest worker's kernels: its share of the cores this run may use.

    torch's CPU kernels run on OpenMP, whose idle threads spin for a while before they sleep.
    Two pytest workers (make test's -n 2) with torch's default of a thread per core each put four
    threads on CI's 2 cores. They then mostly spin. Measured on this machine: two processes
    running a tiny model's matmuls and softmax took 7.8-8.4 s each at 2 threads and 2.3-2.8 s at
    1 thread, and one such pair never finished within 60 s. The unit phase took 596 s this way,
    against 858-905 s before. The torchrun ranks the tests start get OMP_NUM_THREADS=1 already
    (tests/dist/harness.py, as capture_megatron.train.launch gives them)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, usable_cpus() // workers)


def usable_cpus() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


THREADS_GIVEN = "OMP_NUM_THREADS" in os.environ
"""Whether whoever ran pytest chose the thread count (OMP_NUM_THREADS); then it is kept."""
