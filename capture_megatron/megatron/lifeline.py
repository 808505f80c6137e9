"""Processes that must not outlive the process that started them (Linux; a no-op elsewhere).

torchrun starts each rank in a session of its own, and capture-megatron starts fake-cuda profiling
workers; when their parent is SIGKILLed nothing tells them, and a rank would train on and keep
writing checkpoints into the --save directory the failure message names. ``die_with_parent``
asks the kernel to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG);
``adopt_orphans`` makes this process the one that orphaned descendants are re-parented to
(PR_SET_CHILD_SUBREAPER), so a launcher can find and stop what a killed torchrun left.
``forks_die_with_this`` carries the first over a fork, which does not keep it: a rank's forked
children (megatron-core's checkpoint writers) die with the rank. Imports nothing heavy (no
torch): the profiling worker calls it before loading the fake CUDA shim.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int | bytes) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send this process `sig` (default SIGKILL) when its parent dies; exit now when `parent`
    (the parent pid read at start-up) is gone already. Kept across exec: a launcher sets it for
    a child between fork and exec (Popen's preexec_fn)."""
    if _prctl(_PR_SET_PDEATHSIG, int(sig)) and os.getppid() != parent:
        os._exit(1)


def name_this_process(name: str) -> bool:
    """Set the name `ps`, `top` and psutil show for this process (at most 15 bytes are kept): a
    rank forked from its launcher would otherwise show the launcher's; False where unsupported."""
    return _prctl(_PR_SET_NAME, name.encode()[:15])


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants; False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


_FORKING: list[int] = []
"""The pid of a process forking from its main thread, between the fork's two halves (empty:
none, or a fork from another thread)."""


def _before_fork() -> None:
    _FORKING.clear()
    if threading.current_thread() is threading.main_thread():
        _FORKING.append(os.getpid())


def _after_fork_in_child() -> None:
    if _FORKING:
        die_with_parent(_FORKING.pop())


def _after_fork_in_parent() -> None:
    _FORKING.clear()


def forks_die_with_this() -> None:
    """Make every child this process forks from its main thread SIGKILLed when this process dies
    (PR_SET_PDEATHSIG is cleared by fork: megatron-core's forked checkpoint writers outlived a
    SIGKILLed rank). A fork from another thread is left alone: the signal follows the thread that
    forked, and a child would die with that thread, not with the process. A child that execs
    (subprocess, multiprocessing's spawn) gets no fork hook: give it its own die_with_parent."""
    os.register_at_fork(
        before=_before_fork,
        after_in_child=_after_fork_in_child,
        after_in_parent=_after_fork_in_parent,
    )


def finish(join_seconds: float | None = None) -> None:
    """What the interpreter does at exit before its teardown: the threads it would join are
    joined (for at most `join_seconds` in all when given), the exit handlers run
    (multiprocessing's, whose checkpoint-writer Manager shuts down; logging's; temporary files';
    kept profiling workers'), stdout and stderr are flushed."""
    import atexit

    deadline = None if join_seconds is None else time.monotonic() + join_seconds
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            thread.join(left)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (`| head`), a closed stream
            stream.flush()


def exit_now(code: int, join_seconds: float | None = None) -> NoReturn:
    """Exit with `code` as the interpreter would (finish), without its teardown: the process
    ends without freeing its objects one by one (a process that imported torch and megatron-core
    holds ~300k: about 1 s of CPU on a 2-core machine). `join_seconds` bounds the wait for the
    process's other threads (None: as long as they run, which a training rank's checkpoint
    writers need)."""
    finish(join_seconds)
    os._exit(code)
