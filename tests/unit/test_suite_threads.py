"""The test suite's own set-up: each pytest worker's CPU kernels keep to its share of the cores
(tests/conftest.py, tests/worker_threads.py), and so do the processes a test starts."""

import subprocess
import sys

import pytest
import torch
from worker_threads import THREADS_GIVEN, threads_per_worker, usable_cpus


def test_a_pytest_worker_keeps_to_its_share_of_the_cores():
    if THREADS_GIVEN:
        pytest.skip("OMP_NUM_THREADS was given to pytest; it is kept")
    assert torch.get_num_threads() == threads_per_worker()
    code = "import torch; print(torch.get_num_threads())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(child.stdout) == threads_per_worker()


def test_the_share_divides_the_cores_among_the_workers(monkeypatch):
    cpus = usable_cpus()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(cpus))
    assert threads_per_worker() == 1
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(4 * cpus))
    assert threads_per_worker() == 1
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert threads_per_worker() == cpus
