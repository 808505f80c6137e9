"""torchrun as capture-megatron runs it (train.agent, train.job; issue 56): a rank's failure or a
signal is one paragraph, never torchrun's ChildFailedError / SignalException tracebacks, and the
launcher's death -- SIGKILL, which it cannot catch -- ends the whole job, saying so. The slow cases
start real torchrun agents on a process that is not a training rank (`--no-python sleep` or
`false`), so that they cost torchrun's start-up and nothing more."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from capture_megatron.train import agent

AGENT = [sys.executable, "-m", "capture_megatron.train.agent", "--standalone"]
AGENT += ["--nproc-per-node", "2", "--max-restarts", "0", "--no-python"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
"""A rank that waits (its flags after it reach it as arguments it ignores)."""


def test_a_failed_rank_is_one_paragraph():
    killed = agent.failure_paragraph({1: (4242, -9, 5), 0: (4241, -15, 6)})
    assert killed == (
        "torchrun: rank 1 (pid 4242) was killed by SIGKILL, and torchrun stopped every other "
        "rank (rank 0 too)."
    )
    raised = agent.failure_paragraph({0: (7, 2, 1)})
    assert "rank 0 (pid 7) exited with code 2 (its error is above)" in raised
    assert "killed by signal 99" in agent.failure_paragraph({3: (7, -99, 1)})


def test_torchruns_tracebacks_and_shutdown_lines_are_dropped(caplog):
    agent.quiet_torchrun()
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    caplog.set_level(logging.INFO)
    try:
        raise RuntimeError("process 1 terminated with signal SIGKILL")
    except RuntimeError:
        log.exception("failed (exitcode: -9) local_rank: 1 (pid: 5) of fn: run_script_path")
    log.warning("Closing process %s via signal %s", 5, "SIGTERM")
    log.warning("Unable to shutdown process 5 via 15, forcefully exiting via 9")
    assert [r.getMessage() for r in caplog.records] == [
        "Unable to shutdown process 5 via 15, forcefully exiting via 9"
    ]


@pytest.mark.parametrize("argv", [["--save", "/d", "--load", "/e"], ["--load=/e", "--save=/d"]])
def test_flags_are_read_in_both_spellings(argv):
    assert agent.flag_value(argv, "--save") == "/d" and agent.flag_value(argv, "--load") == "/e"
    assert agent.flag_value(argv, "--memory-report") == ""


def test_the_launchers_death_names_what_was_saved(tmp_path):
    not_my_parent = os.getpid()
    text = agent.signal_paragraph(signal.SIGTERM, not_my_parent, ["--save", str(tmp_path)])
    assert f"capture-megatron train (pid {not_my_parent}), which started this job, ended" in text
    assert f"No complete checkpoint under {tmp_path}" in text and "\n" not in text
    own = agent.signal_paragraph(signal.SIGINT, os.getppid(), [])
    assert own == "torchrun: SIGINT received: every rank was stopped."


@pytest.mark.slow  # two torchrun agents (a few seconds each)
def test_a_rank_failure_and_a_signal_to_torchrun_are_one_paragraph(tmp_path):
    failed = subprocess.run([*AGENT, "false"], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    out = failed.stdout + failed.stderr
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert "exited with code 1 (its error is above), and torchrun stopped every other" in out
    proc = subprocess.Popen([*AGENT, *SLEEP], stderr=subprocess.PIPE, text=True)
    ranks = _children(proc.pid, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "torchrun: SIGTERM received: every rank was stopped." in err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


LAUNCHER = textwrap.dedent(
    """
    import os, sys
    from capture_megatron.train.job import run_job
    run_job(sys.argv[1:], dict(os.environ), None, None)
    """
)


@pytest.mark.slow  # a launcher and its torchrun agent
def test_a_sigkilled_launcher_ends_the_whole_job(tmp_path):
    cmd = [sys.executable, "-c", LAUNCHER, *AGENT, *SLEEP, "--save", str(tmp_path)]
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ranks = _children(launcher.pid, 3)  # the agent and its two ranks
        launcher.kill()  # what a scheduler's hard kill does: no handler runs
        launcher.wait()
        gone_by = time.time() + 60
        while time.time() < gone_by and any(_alive(p) for p in ranks):
            time.sleep(0.2)
        assert not [p.pid for p in ranks if _alive(p)]
        err = launcher.stderr.read() if launcher.stderr else ""
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
    assert f"capture-megatron train (pid {launcher.pid}), which started this job, ended" in err
    assert "SIGTERM stopped every rank" in err and "Traceback" not in err, err


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _children(pid: int, count: int) -> list[psutil.Process]:
    """Once the job of `pid` runs its two ranks: the ranks (`count` 2, `pid` the agent), or the
    agent and its ranks (`count` 3, `pid` the launcher)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        found = [p for p in psutil.Process(pid).children(recursive=True) if _alive(p)]
        ranks = [p for p in found if _cmdline(p)[1:3] == SLEEP[1:]]
        if len(ranks) == 2:
            return ranks if count == 2 else found
        time.sleep(0.2)
    raise AssertionError(f"the job of {pid} did not start")


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
