"""The --save directory belongs to one run at a time: a lock file naming its owner.

``capture_megatron.lock`` in the --save directory holds the owner's host, PID, the PID's start
time and when it took the directory (one JSON line); rank 0 of the run takes it before it reads a
checkpoint or writes anything there, holds an exclusive ``flock`` on it for its life, refreshes its
modification time every HEARTBEAT seconds, and empties it when the run ends. Another run --
``capture-megatron train`` before torchrun starts (``check_free``), or any rank 0 of
``pretrain_gpt`` (``SaveLock.acquire``) -- is refused in one paragraph naming the owner while the
owner is alive. A lock left by a run that died (SIGKILL, a lost node) is stale and taken over,
with a note naming it:

- on this host, the kernel's flock tells: a dead process holds none (a PID that was reused by
  another process is told apart by its start time);
- on another host (a shared filesystem, a requeued job on another node), the heartbeat tells: a
  record whose file was not touched for STALE_AFTER seconds is stale. A filesystem whose flock
  spans hosts (NFSv4, Lustre with -o flock) refuses a live owner elsewhere by flock too;
- a Slurm job's earlier start (the record names the same SLURM_JOB_ID with another
  SLURM_RESTART_COUNT): Slurm ended it before it requeued the job, so the requeued start takes the
  directory at once, on whichever node.

The file is never deleted (a process that opened it before a delete would hold a lock on a file
no longer in the directory); an empty file is a free directory. Pure Python (psutil).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

import psutil

from capture_megatron.errors import CaptureError

try:
    import fcntl
except ImportError:  # not POSIX: the owner record and its heartbeat only
    fcntl = None  # type: ignore[assignment]  # a module or None

LOCK = "capture_megatron.lock"
"""The lock file in a --save directory."""
HEARTBEAT = 15.0
"""Seconds between the owner's touches of the lock file."""
STALE_AFTER = 120.0
"""A record of another host untouched for this many seconds is stale (its run is gone)."""


@dataclass(frozen=True)
class Owner:
    """The run that holds a --save directory."""

    host: str
    """Host name of the owning process."""
    pid: int
    """Its process id."""
    started: float
    """The process's start time (seconds since the epoch, psutil's create_time): a reused PID
    has another."""
    since: str
    """When it took the directory (local time, for messages)."""
    job: str = ""
    """The Slurm job and its start ('JOBID.RESTARTS'; '' outside Slurm): a requeued job keeps
    its id, and its earlier start, which Slurm ended before requeueing it, is gone."""

    @classmethod
    def me(cls) -> Owner:
        """This process as an owner."""
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=_started(os.getpid()) or 0.0,
            since=time.strftime("%Y-%m-%d %H:%M:%S"),
            job=slurm_job(),
        )

    def words(self) -> str:
        """The owner in a message."""
        return f"PID {self.pid} on {self.host} (since {self.since})"


def slurm_job(environ: dict | None = None) -> str:
    """'JOBID.RESTARTS' of the Slurm job this process runs in ('' outside Slurm)."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "")
    return f"{job}.{env.get('SLURM_RESTART_COUNT', '0')}" if job else ""


def _started(pid: int) -> float | None:
    """A process's start time, or None when it does not exist."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def read_owner(root: str) -> Owner | None:
    """The owner recorded in `root`'s lock file (None: no file, empty or unreadable)."""
    try:
        with open(os.path.join(root, LOCK), encoding="utf-8") as f:
            data = json.loads(f.read() or "null")
        return Owner(
            str(data["host"]),
            int(data["pid"]),
            float(data["started"]),
            str(data["since"]),
            str(data.get("job", "")),
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None


def stale_reason(owner: Owner, age: float, flock_free: bool) -> str:
    """Why a recorded owner no longer holds the directory ('' when it may still: refuse).
    `age`: seconds since the lock file was last touched; `flock_free`: this process could take
    the file's flock (no live process of this host holds it)."""
    if not flock_free:
        return ""
    mine = slurm_job()
    if owner.job and mine and owner.job != mine and owner.job.split(".")[0] == mine.split(".")[0]:
        return f"it was Slurm job {mine.split('.')[0]}'s start before it was requeued"
    if owner.host == socket.gethostname():
        if owner.pid == os.getpid():
            return "it is this process"
        started = _started(owner.pid)
        if started is None:
            return f"its process {owner.pid} is no longer running"
        if abs(started - owner.started) >= 1.0:
            return f"its process ended and PID {owner.pid} now belongs to another process"
        return ""
    if age > STALE_AFTER:
        return (
            f"its lock was last refreshed {age:.0f} s ago, and a live run refreshes it every "
            f"{HEARTBEAT:.0f} s"
        )
    return ""


def held_text(root: str, owner: Owner | None) -> str:
    """The refusal: another run holds `root`."""
    who = owner.words() if owner else "another process (its record is unreadable)"
    return (
        f"--save {root} is in use by another training run: {who} holds its lock "
        f"({os.path.join(root, LOCK)}). Two runs saving into one directory replace each other's "
        "checkpoints and tracker, so this run does not start. Wait for that run to end, stop it, "
        "or give this one another --save directory. (A run that died leaves a stale lock, which "
        "the next run takes over by itself: on this host at once, from another host after "
        f"{STALE_AFTER:.0f} s.)"
    )


class SaveLock:
    """The lock on one --save directory, held by this process (rank 0) while it trains."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK)
        self.fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> str:
        """Take the directory (creating it); returns a note naming a stale owner that was
        replaced ('' when none); CaptureError while another live run holds it."""
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise CaptureError(
                f"--save {self.root}: cannot create its lock file {self.path} "
                f"({err.strerror or err}); give a --save directory this user can write"
            ) from None
        free = _try_flock(fd)
        owner = read_owner(self.root)
        reason = ""
        if owner is not None:
            reason = stale_reason(owner, time.time() - os.fstat(fd).st_mtime, free)
        if not free or (owner is not None and not reason):
            os.close(fd)
            raise CaptureError(held_text(self.root, owner))
        self.fd = fd
        _write(fd, Owner.me())
        self._beat = threading.Thread(target=self._heartbeat, name="save-lock", daemon=True)
        self._beat.start()
        if owner is None or owner.pid == os.getpid():
            return ""
        return (
            f"--save {self.root}: took over the lock of a run that is gone ({owner.words()}: "
            f"{reason})"
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Free the directory: the record emptied, the flock released."""
        self._stop.set()
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            if fcntl is not None:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        self.fd = None


def _try_flock(fd: int) -> bool:
    """Take the exclusive flock of `fd` without waiting; False when another process holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without flock: the record decides
        return True


def _write(fd: int, owner: Owner) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(asdict(owner)) + "\n").encode(), 0)
    os.fsync(fd)


def check_free(root: str) -> None:
    """CaptureError when a live run holds `root` (what `capture-megatron train` checks before
    starting torchrun; nothing is created or changed)."""
    path = os.path.join(root, LOCK)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or no directory yet): free
    try:
        free = _try_flock(fd)
        owner = read_owner(root)
        if free and fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        if not free or (owner is not None and not stale_reason(owner, _age(fd), free)):
            raise CaptureError(held_text(root, owner))
    finally:
        os.close(fd)


def _age(fd: int) -> float:
    return time.time() - os.fstat(fd).st_mtime
