"""Signals (issue 29, item 11): every signal to `capture-megatron train` reaches every rank.

torchrun starts its ranks in sessions of their own; before train.job a SIGTERM to `train` left them
training and writing checkpoints, a SIGINT printed "interrupted" while they finished, SIGUSR1 never
reached an --exit-signal-handler, and a SIGKILLed torchrun orphaned them. Each test starts a real
2-rank torchrun job through the CLI, waits for its first checkpoint, signals, and then requires the
job to end with no process of it left and nothing more written into --save. The planner's
profiling workers and temporary directory are checked the same way for a SIGTERMed cold `plan`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from capture_megatron.train.checkpoint.save_load import TRACKER, latest_iteration

TINY = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512"),
    *("--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data"),
    *("--no-progress", "--seed", "7", "--train-iters", "400", "--save-interval", "3"),
]
STOPPED_WITHIN = 30
"""Seconds the job may take to end after the signal (train.job: 5 s to SIGKILL; a loaded 2-core
machine takes seconds more to start the interpreters' exits)."""


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "capture_megatron.cli", "train", "--nproc", "2", *TINY]
    proc = subprocess.Popen(
        [*cmd, "--save", str(ckpt), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
    )
    deadline = time.time() + 240
    while not (ckpt / TRACKER).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the job ended before its first checkpoint: " + proc.stdout.read()
    return proc, ckpt


def _finish(proc: subprocess.Popen, job: list[psutil.Process], ckpt: Path) -> str:
    """Wait for the CLI; then no process of the job may be left, nor anything be written into
    --save."""
    try:
        output, _ = proc.communicate(timeout=STOPPED_WITHIN)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    alive = [p for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline()[:4] for p in alive]
    before = sorted(os.listdir(ckpt)), (ckpt / TRACKER).read_text()
    time.sleep(2)
    assert (sorted(os.listdir(ckpt)), (ckpt / TRACKER).read_text()) == before
    assert "]: Traceback" not in output  # no rank's (torchrun's own failure report may have one)
    return output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_every_rank(tmp_path, sig):
    proc, ckpt = _start(tmp_path)
    job = psutil.Process(proc.pid).children(recursive=True)
    (torchrun,) = psutil.Process(proc.pid).children()
    assert len(torchrun.children()) == 2  # the ranks
    os.kill(proc.pid, sig)
    output = _finish(proc, job, ckpt)
    assert proc.returncode == 128 + sig, output[-3000:]
    assert f"stopped by {sig.name}; every rank was stopped with it" in output
    last = (ckpt / TRACKER).read_text().strip()
    assert f"The last complete checkpoint is iteration {last}" in output


def test_sigusr1_with_the_handler_saves_and_stops(tmp_path):
    proc, ckpt = _start(tmp_path, "--exit-signal-handler", "--exit-signal", "SIGUSR1")
    job = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGUSR1)
    output = _finish(proc, job, ckpt)
    assert proc.returncode == 0, output[-3000:]
    last = int((ckpt / TRACKER).read_text())
    assert f"SIGUSR1 received: exiting after iteration {last} of 400 (checkpoint saved)" in output
    assert last > 3 or "saved checkpoint" in output.split("SIGUSR1 sent")[-1]


def test_sigkill_to_torchrun_leaves_no_rank(tmp_path):
    proc, ckpt = _start(tmp_path)
    job = psutil.Process(proc.pid).children(recursive=True)
    (torchrun,) = psutil.Process(proc.pid).children()
    torchrun.send_signal(signal.SIGKILL)
    output = _finish(proc, job, ckpt)
    assert proc.returncode == 128 + signal.SIGKILL, output[-3000:]
    assert "torchrun was killed by SIGKILL; every rank was stopped with it" in output


def test_sigkill_to_the_launcher_ends_the_job_and_frees_save(tmp_path):
    """Issue 56, problem 4: SIGKILL of `capture-megatron train` (kill -9, a scheduler's hard
    kill) left torchrun and every rank training into --save. Now nothing is left, --save is not
    written any more, and its lock is free for the next run (which resumes: the stale lock and
    the resume are test_checkpoint_integrity.py's)."""
    proc, ckpt = _start(tmp_path)
    job = psutil.Process(proc.pid).children(recursive=True)  # torchrun, its ranks, their helpers
    proc.kill()
    proc.wait()
    try:
        deadline = time.time() + STOPPED_WITHIN
        while time.time() < deadline and [p for p in job if _alive(p)]:
            time.sleep(0.2)
        assert not [p.pid for p in job if _alive(p)], "the job outlived its launcher"
        output, _ = proc.communicate(timeout=STOPPED_WITHIN)  # the job held its stdout
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's session is the launcher's
    last = int((ckpt / TRACKER).read_text())
    assert f"capture-megatron train (pid {proc.pid}), which started this job, ended" in output
    assert f"The last complete checkpoint is iteration {last} in {ckpt}" in output
    assert "Traceback" not in output, output[-3000:]
    before = sorted(os.listdir(ckpt)), (ckpt / TRACKER).read_text()
    time.sleep(2)
    assert (sorted(os.listdir(ckpt)), (ckpt / TRACKER).read_text()) == before
    from capture_megatron.train.checkpoint.lock import check_free

    check_free(str(ckpt))  # the next run may take --save
    assert latest_iteration(str(ckpt)) == last


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(process: psutil.Process) -> str:
    """A child's command line; '' for one that has just exited (a zombie not yet reaped, such as
    a short-lived compiler run) or gone."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_sigterm_to_a_cold_plan_leaves_no_worker_or_temp_dir(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TMPDIR=str(temp),
        CAPTURE_MEGATRON_CACHE=str(tmp_path / "cache"),  # cold: nothing profiled yet
        CAPTURE_MEGATRON_WORKERS="2",
    )
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
    model += ["--seq-length", "64", "--vocab-size", "512", "--global-batch-size", "8"]
    cmd = [sys.executable, "-m", "capture_megatron.cli", "plan", *model, "--gpus", "4"]
    proc = subprocess.Popen(
        [*cmd, "--gpu-memory-gib", "80", "--device", "fake", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    deadline, workers = time.time() + 300, []
    while not workers and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        with_children = psutil.Process(proc.pid).children(recursive=True)
        workers = [p for p in with_children if "profile.worker" in _cmdline(p)]
    assert workers, "no profiling worker started: " + (proc.stdout.read() if proc.poll() else "")
    time.sleep(1)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=STOPPED_WITHIN)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output and "Traceback" not in output, output[-3000:]
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in temp.iterdir() if not p.name.startswith("torchinductor_")]
