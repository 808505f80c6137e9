"""Launch `capture_megatron.pretrain_gpt` under torchrun, after validating the flags for the job
size.

run_torchrun (used by `capture-megatron train`, `verify` and `demo`) checks every flag for a job of
N processes (heads vs TP, world size vs TP x PP, batch divisibility, layout, data paths; with
--load, what the resume would change: train.resume) before any process starts, so bad input is
one clear paragraph with exit code 2 — never a torchrun traceback — then runs
`torchrun --standalone --nproc-per-node N -m capture_megatron.pretrain_gpt ...`."""

from __future__ import annotations

import os
import signal
import sys
import tempfile

from capture_megatron.config import TrainConfig
from capture_megatron.errors import CaptureError
from capture_megatron.train.job import run_job


def torchrun_command(
    nproc: int,
    train_args: list[str],
    standalone: bool = True,
    log_dir: str = "",
    fork: bool = False,
) -> list[str]:
    """The torchrun command line that runs pretrain_gpt with `train_args` on one node
    (`log_dir`: torchrun's, instead of a torchelastic_* directory it leaves in the temp dir;
    `fork`: CPU ranks forked from a torchrun that imported torch and megatron-core once, see
    train.preloaded, instead of each importing them in a Python of its own)."""
    if fork:
        from capture_megatron.train.preloaded import PRETRAIN_SCRIPT

        cmd = [sys.executable, "-m", "capture_megatron.train.preloaded"]
        entry = ["--start-method", "fork", "--run-path", PRETRAIN_SCRIPT]
    else:
        cmd = [sys.executable, "-m", "capture_megatron.train.agent"]
        entry = ["-m", "capture_megatron.pretrain_gpt"]
    if standalone:
        cmd.append("--standalone")
    if log_dir:
        cmd += ["--log-dir", log_dir]
    return cmd + ["--nproc-per-node", str(nproc), "--max-restarts", "0", *entry, *train_args]


def validate(nproc: int, train_args: list[str]) -> TrainConfig:
    """Parse `train_args` as pretrain_gpt would for `nproc` processes, refuse what the CPU kernel
    set cannot run when this machine has no CUDA (with CUDA: fused kernels not installed), and
    check a resume against its checkpoint
    (CaptureError on bad input)."""
    if nproc < 1:
        raise CaptureError(f"--nproc {nproc} must be at least 1")
    from capture_megatron.train.entry import parse_config

    cfg = parse_config(train_args, nproc)
    import torch

    if torch.cuda.is_available():  # refused here, not in every rank after torchrun started
        from capture_megatron.megatron.builder import resolve_impl
        from capture_megatron.megatron.extensions import gpu_kernels

        gpu_kernels(cfg.kernels, resolve_impl(cfg.kernels.transformer_impl))
    else:  # the ranks will train on the CPU kernel set
        from capture_megatron.megatron.moe import refuse_on_cpu
        from capture_megatron.train.refusals import refuse_cpu_state

        refuse_on_cpu(cfg.shape)
        refuse_cpu_state(cfg)
    check_outputs(cfg)
    from capture_megatron.train.checkpoint.claim import preflight

    preflight(cfg)
    return cfg


def check_outputs(cfg: TrainConfig) -> None:
    """What the run writes can be written, checked before any process starts: --save (created
    as Megatron-LM creates it), --memory-report and --moe-routing-stats (CaptureError)."""
    from capture_megatron.serial import writable, writable_dir

    if cfg.checkpoint.save:
        writable_dir("--save", cfg.checkpoint.save)
    for flag, path in (
        ("--memory-report", cfg.run.memory_report),
        ("--moe-routing-stats", cfg.run.moe_routing_stats),
    ):
        if path:
            writable(flag, path)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_torchrun(
    nproc: int, train_args: list[str], timeout: float | None = None, env: dict | None = None
) -> int:
    """Validate, then run torchrun in the foreground (train.job: signals reach every rank, a
    stop leaves nothing running); returns its exit code (128 + the signal when one stopped it)."""
    cfg = validate(nproc, train_args)
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    run = cfg.run
    handled = signal.Signals[run.exit_signal] if run.exit_signal_handler else None
    with tempfile.TemporaryDirectory(prefix="capture-megatron-torchrun-") as logs:
        cmd = torchrun_command(nproc, train_args, log_dir=logs, fork=not _has_cuda())
        return run_job(cmd, full_env, timeout, handled)


def failure_message(rc: int, train_args: list[str]) -> str:
    """What went wrong and how to resume: the last complete checkpoint under --save, if any."""
    if rc > 128 and rc - 128 in {int(s) for s in signal.Signals}:
        first = (
            f"capture-megatron train: the job was stopped by {signal.Signals(rc - 128).name}; "
            "every rank was stopped with it."
        )
    elif rc < 0 and -rc in {int(s) for s in signal.Signals}:
        first = (
            f"capture-megatron train: torchrun was killed by {signal.Signals(-rc).name}; every "
            "rank was stopped with it (no rank outlives torchrun)."
        )
    else:
        first = (
            f"capture-megatron train: training failed (torchrun exit code {rc}): a rank died or "
            "raised and torchrun stopped the others (which rank and how: above)."
        )
    from capture_megatron.train.agent import flag_value
    from capture_megatron.train.checkpoint.directory import saved_lines

    save, load = flag_value(train_args, "--save"), flag_value(train_args, "--load")
    return "\n".join([first, *saved_lines(save, load)])
