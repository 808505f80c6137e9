"""The --save directory belongs to one run at a time (train.checkpoint.lock, issue 56): a live
owner -- another process, this host or another -- is refused in one paragraph naming it; a lock
left by a run that died is taken over with a note; the launcher's check changes nothing; a
directory that cannot hold the lock is one paragraph. Owners here are real processes (a Python
that takes the lock and waits), never a mock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from capture_megatron.errors import CaptureError
from capture_megatron.train.checkpoint import lock as save_lock
from capture_megatron.train.checkpoint.lock import LOCK, Owner, SaveLock, check_free, read_owner

HOLDER = textwrap.dedent(
    """
    import sys, time
    from capture_megatron.train.checkpoint.lock import SaveLock
    lock = SaveLock(sys.argv[1])
    lock.acquire()
    print("held", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another live process holding tmp_path/ckpt's lock."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "ckpt")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def _record(root: Path, **fields) -> None:
    root.mkdir(parents=True, exist_ok=True)
    me = Owner.me()
    data = {"host": me.host, "pid": me.pid, "started": me.started, "since": me.since, **fields}
    (root / LOCK).write_text(json.dumps(data))


def test_a_lock_is_taken_released_and_taken_again(tmp_path):
    root = tmp_path / "new" / "ckpt"  # created, as Megatron-LM creates --save
    lock = SaveLock(str(root))
    assert lock.acquire() == ""
    owner = read_owner(str(root))
    assert owner is not None and owner.pid == os.getpid()
    lock.release()
    assert (root / LOCK).read_text() == "" and read_owner(str(root)) is None  # never deleted
    check_free(str(root))
    again = SaveLock(str(root))
    assert again.acquire() == ""
    again.release()


def test_a_live_owner_is_refused_by_the_ranks_and_the_launcher(tmp_path, holder):
    root = str(tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / LOCK).read_text()
    for attempt in (lambda: SaveLock(root).acquire(), lambda: check_free(root)):
        with pytest.raises(CaptureError) as err:
            attempt()
        text = str(err.value)
        assert f"--save {root} is in use by another training run: PID {holder.pid} on " in text
        assert "Wait for that run to end, stop it, or give this one another --save" in text
        assert "\n" not in text
    assert (tmp_path / "ckpt" / LOCK).read_text() == before  # the owner's record untouched


def test_the_lock_of_a_killed_run_is_taken_over_with_a_note(tmp_path, holder):
    holder.kill()
    holder.wait()
    lock = SaveLock(str(tmp_path / "ckpt"))
    check_free(str(tmp_path / "ckpt"))
    note = lock.acquire()
    assert f"took over the lock of a run that is gone (PID {holder.pid} on " in note
    assert f"its process {holder.pid} is no longer running" in note
    lock.release()


def test_a_reused_pid_is_not_the_owner(tmp_path):
    # the record names a live process of this host (the test itself) that started at another
    # time: its PID was reused after the owner died
    _record(tmp_path, pid=os.getppid(), started=1.0)
    lock = SaveLock(str(tmp_path))
    assert f"PID {os.getppid()} now belongs to another process" in lock.acquire()
    lock.release()


def test_another_hosts_lock_is_stale_only_without_heartbeat(tmp_path):
    _record(tmp_path, host="node-that-is-elsewhere", pid=1234)
    with pytest.raises(CaptureError, match="PID 1234 on node-that-is-elsewhere"):
        SaveLock(str(tmp_path)).acquire()  # refreshed just now: a live run
    old = time.time() - 2 * save_lock.STALE_AFTER
    os.utime(tmp_path / LOCK, (old, old))
    check_free(str(tmp_path))
    lock = SaveLock(str(tmp_path))
    assert "its lock was last refreshed" in lock.acquire()
    lock.release()


def test_the_owner_refreshes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(save_lock, "HEARTBEAT", 0.05)
    lock = SaveLock(str(tmp_path))
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK, (old, old))
    deadline = time.time() + 10
    while os.path.getmtime(tmp_path / LOCK) < old + 1 and time.time() < deadline:
        time.sleep(0.05)
    lock.release()
    assert os.path.getmtime(tmp_path / LOCK) > old + 1


def test_an_unreadable_record_of_a_held_lock_is_still_refused(tmp_path, holder):
    (tmp_path / "ckpt" / LOCK).write_bytes(b"\xff\xfe not json")
    with pytest.raises(CaptureError, match="another process \\(its record is unreadable\\)"):
        SaveLock(str(tmp_path / "ckpt")).acquire()


def test_the_launchers_check_creates_nothing(tmp_path):
    check_free(str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()
    check_free(str(tmp_path))
    assert not (tmp_path / LOCK).exists()


def test_a_save_directory_that_cannot_hold_a_lock_is_one_paragraph(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CaptureError, match="cannot create its lock file") as err:
        SaveLock(str(tmp_path / "a-file" / "ckpt")).acquire()
    assert "give a --save directory this user can write" in str(err.value)


def test_a_requeued_slurm_job_takes_its_earlier_starts_lock_on_any_node(tmp_path, monkeypatch):
    """A requeued job keeps its SLURM_JOB_ID (SLURM_RESTART_COUNT grows) and may start on another
    node at once: its earlier start, which Slurm ended before requeueing, holds nothing."""
    _record(tmp_path, host="node-that-is-elsewhere", pid=1234, job="4242.0")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = SaveLock(str(tmp_path))
    assert "it was Slurm job 4242's start before it was requeued" in lock.acquire()
    assert read_owner(str(tmp_path)).job == "4242.1"
    lock.release()
    _record(tmp_path, host="node-that-is-elsewhere", pid=1234, job="977.0")  # another job
    with pytest.raises(CaptureError, match="PID 1234 on node-that-is-elsewhere"):
        SaveLock(str(tmp_path)).acquire()


def test_capture_megatron_train_refuses_a_directory_in_use_before_torchrun(tmp_path, holder):
    from capture_megatron.cli.train import main

    tiny = "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --vocab-size 257"
    args = [*tiny.split(), "--micro-batch-size", "1", "--mock-data", "--train-iters", "2"]
    before = (tmp_path / "ckpt" / LOCK).read_text()
    with pytest.raises(CaptureError, match=f"PID {holder.pid} on "):
        main(["--nproc", "1", *args, "--save", str(tmp_path / "ckpt")])
    assert (tmp_path / "ckpt" / LOCK).read_text() == before
