"""Processes that must not outlive the process that started them (Linux; a no-op elsewhere).

torchrun starts each rank in a session of its own, and capture-megatron starts fake-cuda profiling
workers; when their parent is SIGKILLed nothing tells them, and a rank would train on and keep
writing checkpoints into the --save directory the failure message names. ``die_with_parent``
asks the kernel to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG);
``adopt_orphans`` makes this process the one that orphaned descendants are re-parented to
(PR_SET_CHILD_SUBREAPER), so a launcher can find and stop what a killed torchrun left. Imports
nothing heavy (no torch): the profiling worker calls it before loading the fake CUDA shim.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; exit now when `parent` (the parent pid read at
    start-up) is gone already."""
    if _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)) and os.getppid() != parent:
        os._exit(1)


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants; False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)
