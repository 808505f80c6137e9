"""The fake-cuda worker process: `python -m capture_megatron.profile.worker --serve FD` (started
and kept by capture_megatron.profile.remote.run_in_worker).

Loads the fake CUDA shim before torch, then runs jobs until its standard input ends: each line
`JOB.json OUT.jsonl` names a job's probes, which it runs on the fake-cuda device, writing a byte
to FD per finished probe, the records to OUT.jsonl (a CaptureError to OUT.jsonl.error for the
parent to raise) and then a newline to FD.
"""

from __future__ import annotations

import json
import os
import sys

from capture_megatron.config import Kernels
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import lifeline, quiet
from capture_megatron.records import Probe, write_records
from capture_megatron.serial import from_plain

PARENT = os.getppid()
"""The planner that started this worker, read at import."""


def _job(job_path: str, out: str, fd: int) -> None:
    """Run one job's probes and write its records (or its CaptureError)."""
    from capture_megatron.profile.session import run_probes

    try:
        with open(job_path) as f:
            job = json.load(f)
        probes = [from_plain(Probe, p) for p in job["probes"]]
        kernels = from_plain(Kernels, job["kernels"])
        records = run_probes(
            probes, "fake-cuda", kernels, False, job["timelines"], lambda: os.write(fd, b".")
        )
    except CaptureError as err:
        with open(out + ".error", "w") as f:
            f.write(str(err))
        return
    write_records(records, out)


def main(argv: list[str]) -> int:
    """Worker entry point: --serve FD."""
    _, fd = argv
    lifeline.die_with_parent(PARENT)  # a SIGKILLed planner takes its workers with it
    quiet.install()  # before megatron-core is imported: some of its warnings come at import
    from capture_megatron.emulate import eager_jit, fake_cuda

    eager_jit.install()  # as TORCHDYNAMO_DISABLE, without importing torch.compile's machinery

    fake_cuda.load()
    for line in sys.stdin:
        job_path, out = line.split()
        _job(job_path, out, int(fd))
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(int(fd), b"\n")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything the parent reads is written and closed. Skipping the interpreter's finalisation
    # skips the C++ destructors of the fake-CUDA process's native threads, one of which now and
    # then aborts at exit ("terminate called without an active exception", status -6) after a
    # complete run, as seen on a loaded 2-core machine.
    os._exit(code)
