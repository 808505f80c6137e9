"""Launch `capture_megatron.pretrain_gpt` under torchrun, after validating the flags for the job
size.

run_torchrun (used by `capture-megatron train`, `verify` and `demo`) checks every flag for a job of
N processes (heads vs TP, world size vs TP x PP, batch divisibility, layout, data paths; with
--load, what the resume would change: train.resume) before any process starts, so bad input is
one clear paragraph with exit code 2 — never a torchrun traceback — then runs
`torchrun --standalone --nproc-per-node N -m capture_megatron.pretrain_gpt ...`."""

from __future__ import annotations

import os
import subprocess
import sys

from capture_megatron.config import TrainConfig
from capture_megatron.errors import CaptureError


def torchrun_command(nproc: int, train_args: list[str], standalone: bool = True) -> list[str]:
    """The torchrun command line that runs pretrain_gpt with `train_args` on one node."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if standalone:
        cmd.append("--standalone")
    return cmd + [
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "-m",
        "capture_megatron.pretrain_gpt",
        *train_args,
    ]


def validate(nproc: int, train_args: list[str]) -> TrainConfig:
    """Parse `train_args` as pretrain_gpt would for `nproc` processes, refuse what the CPU kernel
    set cannot run when this machine has no CUDA, and check a resume against its checkpoint
    (CaptureError on bad input)."""
    if nproc < 1:
        raise CaptureError(f"--nproc {nproc} must be at least 1")
    from capture_megatron.train.entry import parse_config

    cfg = parse_config(train_args, nproc)
    import torch

    if not torch.cuda.is_available():  # the ranks will train on the CPU kernel set
        from capture_megatron.megatron.moe import refuse_on_cpu
        from capture_megatron.train.refusals import refuse_cpu_state

        refuse_on_cpu(cfg.shape)
        refuse_cpu_state(cfg)
    if cfg.checkpoint.load:
        from capture_megatron.train.checkpoint import preflight

        preflight(cfg)
    return cfg


def run_torchrun(
    nproc: int, train_args: list[str], timeout: float | None = None, env: dict | None = None
) -> int:
    """Validate, then run torchrun in the foreground; returns its exit code."""
    validate(nproc, train_args)
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    try:
        return subprocess.run(
            torchrun_command(nproc, train_args), env=full_env, timeout=timeout
        ).returncode
    except subprocess.TimeoutExpired:
        raise CaptureError(f"training did not finish within {timeout:.0f} s") from None


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def failure_message(rc: int, train_args: list[str]) -> str:
    """What went wrong and how to resume: the last complete checkpoint under --save, if any."""
    from capture_megatron.train.checkpoint import latest_iteration

    lines = [
        f"capture-megatron train: training failed (torchrun exit code {rc}). A rank died or "
        "raised and torchrun stopped the others; its root-cause report (rank, exit code or "
        "signal) is above."
    ]
    save = _flag_value(train_args, "--save")
    if save:
        try:
            last = latest_iteration(save)
        except CaptureError as err:
            last, lines = None, lines + [str(err)]
        if last is None:
            lines.append(f"No complete checkpoint under {save}: a rerun starts from scratch.")
        else:
            lines.append(
                f"The last complete checkpoint is iteration {last} in {save}: rerun the same "
                f"command with --load {save} to resume from it."
            )
    else:
        lines.append(
            "No --save was given, so nothing can be resumed; add --save DIR --save-interval N."
        )
    return "\n".join(lines)
