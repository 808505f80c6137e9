"""Where this process sits: torchrun's environment, or Slurm's when torchrun's is unset."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from capture_megatron.errors import CaptureError

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What gloo's transport says when the process at the other end of a connection ended."""


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` (or what it wraps) is a collective's failure because another rank's process
    ended."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if any(words in str(e) for words in _PEER_GONE):
            return True
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
    return False


@dataclass(frozen=True)
class DistEnv:
    """Rank coordinates and rendezvous of one training process."""

    rank: int
    """Global rank (RANK, else SLURM_PROCID)."""
    world_size: int
    """Processes in the job (WORLD_SIZE, else SLURM_NTASKS)."""
    local_rank: int
    """Rank on this node, the CUDA device index (LOCAL_RANK, else SLURM_LOCALID)."""
    master_addr: str
    """Rendezvous host (MASTER_ADDR, else the first host of SLURM_JOB_NODELIST)."""
    master_port: int
    """Rendezvous port (MASTER_PORT, else 29500 + SLURM_JOB_ID % 1000; a single process without
    MASTER_PORT: 0, no port, its store is in memory)."""
    source: str
    """torchrun, slurm or single (no launcher: one process)."""


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[03-05,7],cpu1' -> 'gpu03'."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not head:
        raise CaptureError(f"cannot read SLURM_JOB_NODELIST {nodelist!r}")
    prefix, _, ranges = head.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def read_env(environ: dict | None = None) -> DistEnv:
    """The DistEnv from torchrun variables, else Slurm's, else a single process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 29500)),
            "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        port = env.get("MASTER_PORT") or str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000)
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return DistEnv(
            int(env["SLURM_PROCID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_LOCALID", 0)),
            addr,
            int(port),
            "slurm",
        )
    port = int(env.get("MASTER_PORT", 0))
    return DistEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")


def init_distributed(env: DistEnv, backend: str = "") -> str:
    """Initialise torch.distributed for `env`; returns the backend used (nccl on CUDA, else
    gloo)."""
    import datetime

    import torch

    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise CaptureError(
            "--distributed-backend nccl needs CUDA; this machine has none (use gloo)"
        )
    if use_cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if torch.distributed.is_initialized():
        return backend
    # a group of one without MASTER_PORT keeps its store in memory: a free port looked up first
    # could be taken by another process before the store listened on it (EADDRINUSE)
    where: dict = (
        {"store": torch.distributed.HashStore()}
        if env.world_size == 1 and env.master_port == 0
        else {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
    )
    torch.distributed.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(minutes=10),
        **where,
    )
    return backend


def is_logging_rank() -> bool:
    """True on the process that prints (global rank 0, or the only process)."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
