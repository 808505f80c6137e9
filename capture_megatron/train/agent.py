"""torchrun's own main, as capture-megatron runs it: one paragraph for every rank failure and
signal instead of torchrun's tracebacks, and no job without the launcher that started it.

`python -m capture_megatron.train.agent <torchrun flags> -m capture_megatron.pretrain_gpt ...`
(GPU machines) and train.preloaded (CPU ranks forked after importing) run `run(argv)`:

- a rank that fails makes torchrun stop the others and raise ChildFailedError, whose traceback and
  the elastic agent's logged one (with the worker's ProcessExitedException) used to bury its root
  cause; here it is one paragraph -- which rank, how it ended (a signal by name, an exit code), that
  every other rank was stopped -- and exit status 1, as torchrun's;
- a signal to torchrun (SignalException: SIGTERM, SIGINT, SIGHUP, SIGQUIT) stops every rank as
  torchrun does, then one paragraph, exit status 128 + the signal;
- started by `capture-megatron train` (LAUNCHER_ENV names its pid), it dies with it: the launcher's
  death sends it SIGTERM (PR_SET_PDEATHSIG, set before exec by train.job), torchrun stops every
  rank, and the paragraph names the launcher's death and the last complete checkpoint under --save
  (nobody else is left to say it); a watchdog thread SIGKILLs this process STOP_GRACE seconds
  after the launcher's death if it has not ended by then (its ranks die with it: lifeline).

torchrun's shutdown chatter (which process it closes with which signal) is dropped with the
tracebacks; its other log lines are kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time

from capture_megatron.megatron.lifeline import exit_now

LAUNCHER_ENV = "CAPTURE_MEGATRON_LAUNCHER"
"""The pid of the `capture-megatron train` process that started this torchrun (set by
train.job)."""
STOP_GRACE = 20.0
"""Seconds after the launcher's death before the watchdog SIGKILLs a torchrun still running."""
AGENT_JOIN_SECONDS = 10.0
"""How long the agent waits at exit for torchrun's threads: it holds no checkpoint (its ranks
are other processes), and a signal can leave one of torchrun's threads waiting for good (seen
once in CI: the paragraph printed, the agent still alive a minute later)."""
CHATTER = (
    "Closing process",
    "Sending process",
    "Terminating process",
    "death signal",
    "Got termination signal",
    "failed (exitcode",
    "worker 0 failed",
)
"""torchrun log lines the paragraph replaces."""
LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.multiprocessing.spawn",
)
"""The loggers that print them."""


class _NoChatter(logging.Filter):
    """Drops torchrun's tracebacks and shutdown lines (CHATTER)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record the paragraph replaces."""
        text = str(record.msg)
        return not (record.exc_info or any(words in text for words in CHATTER))


def quiet_torchrun() -> None:
    """Install the filter on torchrun's loggers."""
    for name in LOGGERS:
        logging.getLogger(name).addFilter(_NoChatter())


def _how(exitcode: int) -> str:
    """How a process ended, in words."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}" + (" (its error is above)" if exitcode else "")


def failure_paragraph(failures: dict[int, tuple[int, int, int]]) -> str:
    """The paragraph of a failed job: `failures` maps each failed rank to (pid, exit code,
    time); the first to fail is the root cause (torchrun's rule)."""
    rank = min(failures, key=lambda r: (failures[r][2], r))
    pid, code, _ = failures[rank]
    others = sorted(r for r in failures if r != rank)
    text = f"torchrun: rank {rank} (pid {pid}) {_how(code)}, and torchrun stopped every other rank"
    if others:
        text += f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too)"
    return text + "."


def flag_value(argv: list[str], flag: str) -> str:
    """A flag's value as a command line gives it, `--flag VALUE` or `--flag=VALUE` ('' when
    absent; Megatron-LM's parser takes no abbreviations, and neither does capture-megatron's)."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return ""


def launcher_gone(launcher: int) -> bool:
    """Whether the launcher that started this process is no longer its parent."""
    return os.getppid() != launcher


def _watchdog(launcher: int) -> None:
    while not launcher_gone(launcher):
        time.sleep(0.5)
    time.sleep(STOP_GRACE)
    os.kill(os.getpid(), signal.SIGKILL)


def _launcher() -> int | None:
    value = os.environ.get(LAUNCHER_ENV, "")
    return int(value) if value.isdigit() else None


def signal_paragraph(sig: signal.Signals, launcher: int | None, argv: list[str]) -> str:
    """The paragraph of a job stopped by a signal to torchrun (after the launcher's death: that,
    and the last complete checkpoint)."""
    if launcher is not None and launcher_gone(launcher):
        from capture_megatron.train.checkpoint.directory import saved_lines

        return " ".join(
            [
                f"torchrun: capture-megatron train (pid {launcher}), which started this job, "
                f"ended without stopping it (killed?); {sig.name} stopped every rank.",
                *saved_lines(flag_value(argv, "--save"), ""),
            ]
        )
    return f"torchrun: {sig.name} received: every rank was stopped."


def run(argv: list[str]) -> int:
    """torchrun's main with `argv`; returns the exit status (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    quiet_torchrun()
    launcher = _launcher()
    if launcher is not None:
        threading.Thread(target=_watchdog, args=(launcher,), daemon=True, name="launcher").start()
    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        failures = {r: (f.pid, f.exitcode, f.timestamp) for r, f in err.failures.items()}
        print(failure_paragraph(failures), file=sys.stderr, flush=True)
        return 1
    except SignalException as err:
        sig = signal.Signals(err.sigval)
        print(signal_paragraph(sig, launcher, argv), file=sys.stderr, flush=True)
        if launcher is not None and launcher_gone(launcher):  # its temporary log directory
            shutil.rmtree(flag_value(argv, "--log-dir"), ignore_errors=True)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    exit_now(run(sys.argv[1:]), AGENT_JOIN_SECONDS)
