"""Faults: a rank SIGKILLed mid-run stops the whole job (torchrun ends the others; a hang fails the
120 s timeout) with a clear message, and a relaunch with --load resumes from the last checkpoint
with the losses of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness import TINY, losses, train

from capture_megatron.train.checkpoint.save_load import TRACKER

# a long schedule (so the kill surely lands mid-run); every run stops at --exit-interval 12 or
# earlier
LONG = ["--train-iters", "400", "--lr-decay-iters", "400", "--pipeline-model-parallel-size", "2"]


def _worker(root: psutil.Process, rank: int) -> psutil.Process:
    """The rank's process: forked from a preloaded torchrun, it is named for its rank (its
    environment as psutil reads it is the launcher's); started by torchrun, its environment
    names it."""
    for child in root.children(recursive=True):
        try:
            if child.name() == f"rank {rank}" or (
                child.environ().get("RANK") == str(rank)
                and "pretrain_gpt" in " ".join(child.cmdline())
            ):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no worker with RANK={rank} under pid {root.pid}")


def test_sigkill_one_rank_then_resume(data_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = [*TINY, "--data-path", data_prefix, *LONG]
    cmd = [
        sys.executable,
        "-m",
        "capture_megatron.cli",
        "train",
        "--nproc",
        "4",
        *args,
        "--save",
        ckpt,
        "--save-interval",
        "3",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while (
            not os.path.exists(os.path.join(ckpt, TRACKER))
            and time.time() < deadline
            and proc.poll() is None
        ):
            time.sleep(0.2)
        assert proc.poll() is None, (
            "the job ended before the first checkpoint: " + proc.stdout.read()[-3000:]
        )
        victim = _worker(psutil.Process(proc.pid), 3)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=120)
        stopped_after = time.time() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    last = int(Path(ckpt, TRACKER).read_text().strip())
    print(
        f"job stopped {stopped_after:.1f} s after SIGKILL of rank 3; last checkpoint: "
        f"iteration {last}"
    )
    assert proc.returncode != 0
    assert "torchrun: rank 3 (pid " in output and "was killed by SIGKILL" in output, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    assert f"The last complete checkpoint is iteration {last} in {ckpt}" in output, output[-3000:]
    assert 3 <= last < 12, "kill landed too late for the comparison window"
    straight = losses(train(4, [*args, "--exit-interval", "12"], str(tmp_path), "straight"))
    resumed = train(4, [*args, "--exit-interval", "12", "--load", ckpt], str(tmp_path), "resumed")
    assert [it.iteration for it in resumed.report.iterations] == list(range(last + 1, 13))
    assert losses(resumed) == pytest.approx(straight[last:], rel=1e-6)
