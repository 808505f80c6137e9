"""Run fake-cuda probes in worker processes (capture_megatron.profile.worker), several at once.

The fake CUDA shim (capture_megatron.emulate.fake_cuda) must be loaded before torch is imported, so
fake-cuda probes cannot run in a process that imported torch already (the planner's, a test's).
run_in_worker() deals the probes out to workers -- one per CPU this process may use (at most
MAX_WORKERS, at least MIN_PROBES probes each; $CAPTURE_MEGATRON_WORKERS overrides) -- each running

    python -m capture_megatron.profile.worker JOB.json OUT.jsonl

Each worker writes a byte per finished probe to a pipe, from which this process draws one progress
bar; their stdout and stderr are this process's. A CaptureError in a worker comes back as one.
Probes are independent (each builds its own chunk), so the records do not depend on how they are
dealt out; they come back in the order of `probes`.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from capture_megatron.config import Kernels
from capture_megatron.errors import CaptureError
from capture_megatron.records import Probe, ProfileRecord, read_records
from capture_megatron.serial import to_plain

MAX_WORKERS = 8
"""Most worker processes at once (each holds a full megatron-core import, ~0.5 GiB)."""
MIN_PROBES = 12
"""Fewest probes worth a worker: starting one (imports) costs about as much as 12 probes."""


def worker_count(probes: int) -> int:
    """Workers for `probes` probes on this machine."""
    given = os.environ.get("CAPTURE_MEGATRON_WORKERS", "")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise CaptureError(f"$CAPTURE_MEGATRON_WORKERS {given!r} must be a positive integer")
        cpus = int(given)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, min(cpus, MAX_WORKERS, probes // MIN_PROBES))


@dataclass(frozen=True)
class _Worker:
    """One started worker and its files."""

    process: subprocess.Popen
    """The worker process."""
    ticks: int
    """The read end of its progress pipe (a byte per finished probe)."""
    out: str
    """Where it writes its records."""
    indices: tuple[int, ...]
    """Which of the probes it runs (positions in the caller's list)."""


def _start(
    tmp: str,
    k: int,
    probes: list[Probe],
    indices: range,
    kernels: Kernels,
    timelines: bool,
) -> _Worker:
    job, out = os.path.join(tmp, f"job{k}.json"), os.path.join(tmp, f"records{k}.jsonl")
    read, write = os.pipe()
    with open(job, "w") as f:
        json.dump(
            {
                "probes": [to_plain(probes[i]) for i in indices],
                "kernels": to_plain(kernels),
                "progress_fd": write,
                "timelines": timelines,
            },
            f,
        )
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "capture_megatron.profile.worker", job, out],
            env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
            pass_fds=(write,),
        )
    finally:
        os.close(write)
    return _Worker(process, read, out, tuple(indices))


def _follow(workers: list[_Worker], total: int, progress: bool) -> None:
    """Wait for every worker, advancing one progress bar by their lines."""
    from tqdm import tqdm

    bar = tqdm(
        total=total,
        desc=f"profiling (fake-cuda, {len(workers)} workers)",
        unit="probe",
        disable=not progress,
        dynamic_ncols=True,
    )
    with selectors.DefaultSelector() as sel:
        for w in workers:
            sel.register(w.ticks, selectors.EVENT_READ)
        while sel.get_map():
            for key, _ in sel.select():
                ticks = os.read(key.fd, 4096)
                if ticks:
                    bar.update(len(ticks))
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
    bar.close()
    for w in workers:
        w.process.wait()


def _collect(w: _Worker) -> list[ProfileRecord]:
    if os.path.exists(w.out + ".error"):
        with open(w.out + ".error") as f:
            raise CaptureError(f.read())
    if w.process.returncode or not os.path.exists(w.out):
        raise CaptureError(
            f"a fake-cuda profiling worker failed (exit status {w.process.returncode}); its "
            "output is above"
        )
    return read_records(w.out)


def run_in_worker(
    probes: list[Probe], kernels: Kernels, progress: bool, timelines: bool
) -> list[ProfileRecord]:
    """Run fake-cuda probes in worker processes and return their records in probe order."""
    if not probes:
        return []
    n = worker_count(len(probes))
    from capture_megatron.emulate.fake_cuda import shim_path

    shim_path()  # compile the shim once, here, not in every worker at once
    with tempfile.TemporaryDirectory(prefix="capture-megatron-") as tmp:
        workers = [
            _start(tmp, k, probes, range(k, len(probes), n), kernels, timelines) for k in range(n)
        ]
        try:
            _follow(workers, len(probes), progress)
        finally:  # also on Ctrl-C / SIGTERM (cli: Stopped): no worker outlives the profile
            for w in workers:
                if w.process.poll() is None:
                    w.process.kill()
                w.process.wait()
        records: list[ProfileRecord | None] = [None] * len(probes)
        for w in workers:
            for i, record in zip(w.indices, _collect(w), strict=True):
                records[i] = record
    return [r for r in records if r is not None]
