"""pytest plugin: a session-scoped `slurm_cluster` fixture that starts the one-node test cluster.

Use it from a test directory by importing it in that directory's conftest.py:
    from slurm_fixture import slurm_cluster  # noqa: F401   (with tests/slurm on sys.path)
If the cluster cannot start, the tests that use the fixture FAIL with the start script's output.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class SlurmCluster:
    """What tests need to talk to the cluster."""

    env: dict
    """Environment for sbatch/squeue (SLURM_CONF set)."""
    partition: str
    """The partition jobs go to."""


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """Start (or reuse) the cluster; fail loudly with the script's output if it cannot start.
    Skipped (with the reason) for a user who is not root: slurmctld, slurmd and munge need root."""
    if os.geteuid() != 0:
        pytest.skip(
            "the test Slurm cluster needs root (tests/slurm/start_slurm.sh); CI runs as root"
        )
    run_dir = os.environ.get("CAPTURE_SLURM_RUN", "/tmp/capture-megatron-slurm")
    done = subprocess.run(
        ["bash", os.path.join(HERE, "start_slurm.sh"), run_dir],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        pytest.fail(
            "the test Slurm cluster did not start:\n" + done.stdout + done.stderr, pytrace=False
        )
    conf = done.stdout.strip().splitlines()[-1].split("=", 1)[1]
    return SlurmCluster(env=dict(os.environ, SLURM_CONF=conf), partition="debug")
