"""The Slurm tests use the session cluster fixture (tests/slurm/slurm_fixture.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "dist"))

from slurm_fixture import slurm_cluster  # noqa: E402,F401
