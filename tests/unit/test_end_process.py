"""A training process ends without the interpreter's teardown (capture_megatron.train.entry.
end_process) but with everything a normal exit does first: its non-daemon threads finish, its exit
handlers run, its buffered output is written, and the exit code is the one given."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, sys, threading, time
from capture_megatron.train.entry import end_process
out = sys.argv[1]
def late():
    time.sleep(0.3)
    with open(out + ".thread", "w") as f:
        f.write("joined")
threading.Thread(target=late).start()
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
sys.stdout.write("buffered, no newline")
end_process(3)
"""


def test_end_process_joins_threads_runs_exit_handlers_and_flushes(tmp_path):
    out = str(tmp_path / "mark")
    env = {"PYTHONUNBUFFERED": ""}  # stdout a block-buffered pipe, as under torchrun
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, out], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert (tmp_path / "mark.thread").read_text() == "joined"
    assert (tmp_path / "mark.atexit").read_text() == "ran"
