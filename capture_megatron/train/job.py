"""A torchrun job in the foreground: every signal capture-megatron gets reaches every rank, a stop
stops all of it, and nothing is left running.

torchrun starts each rank in a session of its own, so a signal to `capture-megatron train` (or a
Ctrl-C at the terminal, which reaches the foreground process group) never reached the ranks: they
trained on, writing checkpoints. Here the launcher catches SIGINT, SIGTERM, SIGHUP, SIGQUIT,
SIGUSR1 and SIGUSR2 while the job runs and:

- the signal the ranks handle (--exit-signal-handler's --exit-signal) goes to every rank as it is:
  they save a checkpoint (with --save) and stop together, as Megatron-LM's ranks do;
- SIGUSR1 / SIGUSR2 otherwise go to every rank as they are too (their default action ends a rank,
  as it would end a Megatron-LM rank; torchrun then ends the others);
- SIGINT, SIGTERM, SIGHUP and SIGQUIT stop the job: SIGTERM to every rank (a clean end, no Python
  traceback per rank), and STOP_GRACE seconds later SIGKILL to whatever of the job still runs; a
  second stop signal kills at once. The exit status is 128 + the signal's number.

The launcher is the subreaper of the job (megatron.lifeline): ranks orphaned by a SIGKILLed
torchrun -- which die with it anyway (each rank asks for SIGKILL on its parent's death) -- and the
processes ranks start (megatron-core's checkpoint writer Manager) are re-parented to it, and
whatever of the job is left when torchrun ends is killed and reaped.

The launcher's own death ends the job too: torchrun is started with PR_SET_PDEATHSIG = SIGTERM
(set between fork and exec, so no window), stops every rank on it and says what was saved
(train.agent); a watchdog there SIGKILLs it if it has not ended STOP_GRACE seconds later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

import psutil

from capture_megatron.errors import CaptureError
from capture_megatron.megatron import lifeline
from capture_megatron.train.agent import LAUNCHER_ENV

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""Signals that stop the job."""
FORWARDED = (*STOPPING, signal.SIGUSR1, signal.SIGUSR2)
"""Signals the launcher catches while the job runs."""
STOP_GRACE = 5.0
"""Seconds between the SIGTERM of a stop and the SIGKILL of what remains."""


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def _send(processes: list[psutil.Process], sig: signal.Signals) -> None:
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


class Job:
    """One running torchrun job and the signal forwarding around it."""

    def __init__(self, cmd: list[str], env: dict, handled: signal.Signals | None) -> None:
        lifeline.adopt_orphans()
        self.handled = handled
        self.stopped_by: signal.Signals | None = None
        self.kill_at: float | None = None
        launcher = os.getpid()
        self.proc = subprocess.Popen(
            cmd,
            env=dict(env, **{LAUNCHER_ENV: str(launcher)}),
            preexec_fn=lambda: lifeline.die_with_parent(launcher, signal.SIGTERM),
        )
        self.previous: dict = {}
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self.previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED}

    def _ranks(self) -> list[psutil.Process]:
        """torchrun's children: the ranks."""
        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if sig == self.handled or sig not in STOPPING:
            _send(self._ranks(), sig)
            print(f"capture-megatron: {sig.name} sent to every rank", file=sys.stderr, flush=True)
            return
        if self.stopped_by is not None:  # a second stop: now
            self.kill_at = 0.0
            return
        self.stopped_by = sig
        self.kill_at = time.monotonic() + STOP_GRACE
        print(
            f"capture-megatron: {sig.name} received: stopping every rank (SIGKILL in "
            f"{STOP_GRACE:.0f} s for what is left)",
            file=sys.stderr,
            flush=True,
        )
        _send(self._ranks(), signal.SIGTERM)

    def _kill_all(self) -> None:
        """SIGKILL every process of the job (this process's descendants) and reap them."""
        left = _descendants()
        _send(left, signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)

    def wait(self, timeout: float | None) -> int:
        """Wait for the job; returns torchrun's exit code, or 128 + the signal that stopped it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    rc = self.proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    now = time.monotonic()
                    if self.kill_at is not None and now >= self.kill_at:
                        self._kill_all()
                    if deadline is not None and now >= deadline:
                        self._kill_all()
                        raise CaptureError(
                            f"training did not finish within {timeout:.0f} s"
                        ) from None
        finally:
            for s, handler in self.previous.items():
                signal.signal(s, handler)
            self._kill_all()  # what a killed torchrun or a rank left behind
        return 128 + int(self.stopped_by) if self.stopped_by is not None else rc


def run_job(
    cmd: list[str], env: dict, timeout: float | None, handled: signal.Signals | None
) -> int:
    """Run `cmd` (torchrun) with the signal handling above; returns its exit status."""
    return Job(cmd, env, handled).wait(timeout)
