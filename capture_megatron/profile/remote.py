"""Run fake-cuda probes in worker processes (capture_megatron.profile.worker), several at once.

The fake CUDA shim (capture_megatron.emulate.fake_cuda) must be loaded before torch is imported, so
fake-cuda probes cannot run in a process that imported torch already (the planner's, a test's).
run_in_worker() deals the probes out to workers -- one per CPU this process may use (at most
MAX_WORKERS; a new worker only for at least MIN_PROBES probes; $CAPTURE_MEGATRON_WORKERS
overrides) -- each started once as

    python -m capture_megatron.profile.worker --serve FD

and kept for the rest of this process: a search profiles in rounds, and starting a worker (its
torch and megatron-core imports) costs about as much as a dozen probes, so every round after the
first reuses the workers of the rounds before, whatever kernel set they ran (a job names its
kernel set; the patches a worker applies are the same for every set, and each probe builds its
chunk from its job's set). Each job is a line
`JOB.json OUT.jsonl` on the worker's standard input; the worker writes a byte per finished probe
to its pipe FD and a newline when the job's records are written, from which this process draws
one progress bar; their stdout and stderr are this process's. A CaptureError in a worker comes
back as one. Probes are independent (each builds its own chunk), so the records do not depend on
how they are dealt out or which worker ran probes before; they come back in the order of
`probes`. The workers end with this process (end of input; the kernel's parent-death signal if
it is killed), and are killed when a round fails or is interrupted.
"""

from __future__ import annotations

import atexit
import contextlib
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
"""Fewest probes worth starting a worker for: starting one (imports) costs about as much as 12
probes (a worker kept from an earlier round costs nothing)."""


def _cpus() -> int:
    given = os.environ.get("CAPTURE_MEGATRON_WORKERS", "")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise CaptureError(f"$CAPTURE_MEGATRON_WORKERS {given!r} must be a positive integer")
        return int(given)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def worker_count(probes: int, running: int = 0) -> int:
    """Workers for `probes` probes on this machine when `running` workers are kept already: new
    ones only where each gets MIN_PROBES probes; kept ones as long as each gets a probe."""
    most = min(_cpus(), MAX_WORKERS)
    return max(1, min(most, max(probes // MIN_PROBES, min(running, probes))))


@dataclass(frozen=True)
class _Worker:
    """One started worker, kept for the process's later rounds."""

    process: subprocess.Popen
    """The worker process (its standard input takes the jobs)."""
    ticks: int
    """The read end of its progress pipe (a byte per finished probe, a newline per job)."""


_KEPT: list[_Worker] = []
"""The workers started by this process and still running."""


def _start() -> _Worker:
    from capture_megatron.emulate.fake_cuda import cuda_build, shim_path

    if not cuda_build():
        shim_path()  # compile the shim once, here, not in every worker at once
    read, write = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "capture_megatron.profile.worker", "--serve", str(write)],
            env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
            pass_fds=(write,),
            stdin=subprocess.PIPE,
        )
    finally:
        os.close(write)
    return _Worker(process, read)


def _stop(workers: list[_Worker], kill: bool) -> None:
    """End these workers (close their input, or kill them) and forget them."""
    for w in workers:
        if kill and w.process.poll() is None:
            w.process.kill()
        if w.process.stdin is not None:
            with contextlib.suppress(OSError):  # a killed worker's pipe
                w.process.stdin.close()
        w.process.wait()
        os.close(w.ticks)
        if w in _KEPT:
            _KEPT.remove(w)


atexit.register(lambda: _stop(list(_KEPT), kill=False))


def _workers(probes: int) -> list[_Worker]:
    """The workers for a round: those kept from earlier rounds (of any kernel set), and new ones
    as worker_count says (kept ones that ended are forgotten first)."""
    _stop([w for w in _KEPT if w.process.poll() is not None], kill=True)
    n = worker_count(probes, len(_KEPT))
    while len(_KEPT) < n:
        _KEPT.append(_start())
    return _KEPT[:n]


def _submit(w: _Worker, job: str, out: str) -> None:
    assert w.process.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # a worker gone: _collect says it failed
        w.process.stdin.write(f"{job} {out}\n".encode())
        w.process.stdin.flush()


def _follow(workers: list[_Worker], total: int, progress: bool) -> None:
    """Wait until every worker has finished its job (a newline) or ended, advancing one progress
    bar by their ticks."""
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
                bar.update(ticks.count(b"."))
                if not ticks or b"\n" in ticks:
                    sel.unregister(key.fd)
    bar.close()


def _collect(w: _Worker, out: str) -> list[ProfileRecord]:
    if os.path.exists(out + ".error"):
        with open(out + ".error") as f:
            raise CaptureError(f.read())
    if w.process.poll() is not None or not os.path.exists(out):
        raise CaptureError(
            f"a fake-cuda profiling worker failed (exit status {w.process.poll()}); its "
            "output is above"
        )
    return read_records(out)


def run_in_worker(
    probes: list[Probe], kernels: Kernels, progress: bool, timelines: bool
) -> list[ProfileRecord]:
    """Run fake-cuda probes in worker processes and return their records in probe order."""
    if not probes:
        return []
    workers = _workers(len(probes))
    n = len(workers)
    records: list[ProfileRecord | None] = [None] * len(probes)
    with tempfile.TemporaryDirectory(prefix="capture-megatron-") as tmp:
        outs = []
        try:
            for k, w in enumerate(workers):
                job, out = os.path.join(tmp, f"job{k}.json"), os.path.join(tmp, f"records{k}.jsonl")
                indices = range(k, len(probes), n)
                with open(job, "w") as f:
                    json.dump(
                        {
                            "probes": [to_plain(probes[i]) for i in indices],
                            "kernels": to_plain(kernels),
                            "timelines": timelines,
                        },
                        f,
                    )
                _submit(w, job, out)
                outs.append((w, out, indices))
            _follow(workers, len(probes), progress)
            for w, out, indices in outs:
                for i, record in zip(indices, _collect(w, out), strict=True):
                    records[i] = record
        except BaseException:  # also on Ctrl-C / SIGTERM (cli: Stopped): no worker outlives it
            _stop(list(_KEPT), kill=True)
            raise
    return [r for r in records if r is not None]
