"""Run fake-cuda probes in a worker process (capture_megatron.profile.worker).

The fake CUDA shim (capture_megatron.profile.fake_cuda) must be loaded before torch is imported, so
fake-cuda probes cannot run in a process that imported torch already (the planner's, a test's).
run_in_worker() writes the probes to a job file and runs

    python -m capture_megatron.profile.worker JOB.json OUT.jsonl

whose progress bar shares this process's stderr; a CaptureError in the worker comes back as one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from capture_megatron.config import Kernels
from capture_megatron.errors import CaptureError
from capture_megatron.records import Probe, ProfileRecord, read_records
from capture_megatron.serial import to_plain


def run_in_worker(
    probes: list[Probe], kernels: Kernels, progress: bool, timelines: bool
) -> list[ProfileRecord]:
    """Run fake-cuda probes in a worker process and return its records."""
    if not probes:
        return []
    with tempfile.TemporaryDirectory(prefix="capture-megatron-") as tmp:
        job, out = os.path.join(tmp, "job.json"), os.path.join(tmp, "records.jsonl")
        with open(job, "w") as f:
            json.dump(
                {
                    "probes": [to_plain(p) for p in probes],
                    "kernels": to_plain(kernels),
                    "progress": progress,
                    "timelines": timelines,
                },
                f,
            )
        done = subprocess.run(
            [sys.executable, "-m", "capture_megatron.profile.worker", job, out],
            env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
        )
        if os.path.exists(out + ".error"):
            with open(out + ".error") as f:
                raise CaptureError(f.read())
        if done.returncode or not os.path.exists(out):
            raise CaptureError(
                f"the fake-cuda profiling worker failed (exit status {done.returncode}); its "
                "output is above"
            )
        return read_records(out)
