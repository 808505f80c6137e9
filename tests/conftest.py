"""Shared pytest set-up: markers by folder (tests/dist -> dist, tests/slurm -> slurm, tests/gpu ->
gpu) and megatron's import-time warnings kept out of the output.

Which tests to run when: CONTRIBUTING.md (make test-fast after every change; make test before a
push, which is what CI runs)."""

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
