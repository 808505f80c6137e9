"""Shared pytest set-up: markers by folder (tests/dist -> dist, tests/slurm -> slurm, tests/gpu ->
gpu), each pytest worker's CPU kernels kept to its share of the cores (threads_per_worker),
megatron's import-time warnings kept out of the output, and torch / megatron-core unpatched again
after every test that applied capture-megatron's patches (the patch registry,
capture_megatron/emulate/patches.py).

Which tests to run when: CONTRIBUTING.md (make test-fast after every change; make test before a
push, which is what CI runs)."""

import os
import pathlib
import sys
import warnings

import pytest
from worker_threads import THREADS_GIVEN, threads_per_worker


def pytest_configure(config: pytest.Config) -> None:
    """Give this test process (a pytest-xdist worker, or pytest without -n) and the processes
    its tests start their share of the cores, before torch is imported (its thread pool reads
    OMP_NUM_THREADS). The controller of `-n N` runs no test and leaves it to its workers."""
    controller = bool(getattr(config.option, "numprocesses", None))
    if THREADS_GIVEN or (controller and not os.environ.get("PYTEST_XDIST_WORKER")):
        return
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker())
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads_per_worker())


os.environ.setdefault("CAPTURE_MEGATRON_KEEP_PLANS", "0")  # tests plan; test_kept_plans reads back
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

PATCH_LOG = "CAPTURE_MEGATRON_PATCH_LOG"
"""Environment variable: a file to which `unpatched` appends each test's id and how many patches
it reverted (tests/unit/test_patch_registry.py reads it)."""

FOLDER_MARKS = {"dist": pytest.mark.dist, "slurm": pytest.mark.slurm, "gpu": pytest.mark.gpu}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by the folder it lives in."""
    for item in items:
        folder = pathlib.Path(str(item.fspath)).parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])


@pytest.fixture
def forecast_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One profiling cache for the slow tests that forecast inputs nobody here wrote (Megatron-LM's
    functional tests and launch lines, published configs), marked xdist_group("forecasts") so that
    one pytest worker runs them in order (make test: --dist loadgroup). Several of them forecast
    the same command lines (the functional tests' development cases, the Mixtral line), and a
    forecast from cached records equals the cold one (the records are what the cold run measures
    and stores).
    Tests of the cache itself or of a cold run's output keep a cache of their own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's base is one folder below the session's
        root = root.parent
    return str(root / "forecast-cache")


@pytest.fixture(autouse=True)
def unpatched(request: pytest.FixtureRequest):
    """After each test, revert whatever it patched through the registry (torch and megatron-core
    attributes, the TorchFunctionModes it entered), so that no test sees another's patches."""
    yield
    from capture_megatron.emulate import patches

    count = len(patches.applied())
    if count or patches.device() is not None:
        patches.revert()
    if os.environ.get(PATCH_LOG):
        with open(os.environ[PATCH_LOG], "a") as log:
            log.write(f"{request.node.nodeid}\t{count}\n")
