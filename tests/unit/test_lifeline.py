"""capture_megatron.megatron.lifeline: a process's forked children die with it (what megatron-core's
checkpoint writers needed, tests/dist/test_checkpoint.py), except children forked from another
thread, which would die with that thread (PR_SET_PDEATHSIG follows the forking thread)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

PARENT = textwrap.dedent(
    """
    import os, sys, threading, time
    from capture_megatron.megatron import lifeline

    if sys.argv[1] == "hooked":
        lifeline.forks_die_with_this()

    def child():
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        return pid

    main = child()
    box = []
    thread = threading.Thread(target=lambda: box.append(child()))
    thread.start()
    thread.join()
    print(main, box[0], flush=True)
    time.sleep(60)
    """
)


def _children_after_parent_killed(mode: str, wait: float) -> tuple[bool, bool]:
    """Whether the child forked from the main thread and the one forked from another thread are
    alive once the first had `wait` s to die after their parent was SIGKILLed (both killed here
    before returning)."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    main, other = (int(x) for x in proc.stdout.readline().split())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + wait
    while time.time() < deadline and psutil.pid_exists(main):
        time.sleep(0.1)
    alive = []
    for pid in (main, other):
        try:
            alive.append(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
            os.kill(pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            alive.append(False)
    return alive[0], alive[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_forked_from_the_main_thread_die_with_their_parent():
    assert _children_after_parent_killed("plain", 1.0) == (True, True)  # fork drops PDEATHSIG
    assert _children_after_parent_killed("hooked", 10.0) == (False, True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_a_named_process_shows_its_name():
    """A rank forked from its launcher names itself (train.entry): ps and psutil show the name."""
    code = (
        "import psutil; from capture_megatron.megatron.lifeline import name_this_process; "
        "print(name_this_process('rank 12 of a long name'), psutil.Process().name())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "rank", "12", "of", "a", "lo"]  # the first 15 bytes
