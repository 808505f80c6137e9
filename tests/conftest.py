"""Shared pytest set-up: markers by folder (tests/dist -> dist, tests/slurm -> slurm, tests/gpu ->
gpu) and megatron's import-time warnings kept out of the output.

Which tests to run when: CONTRIBUTING.md (make test-fast after every change; make test before a
push, which is what CI runs)."""

import os
import pathlib
import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

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
