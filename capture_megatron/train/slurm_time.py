"""Slurm time limits (`--time`), and the warning `capture-megatron launch` gives when the cost
model's estimate of the run is longer. Pure Python."""

from __future__ import annotations

import math
import re

from capture_megatron.errors import CaptureError

UNLIMITED = ("UNLIMITED", "INFINITE")
"""--time values that mean no limit (the partition's MaxTime applies)."""
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_seconds(text: str) -> int | None:
    """Seconds of a Slurm --time value, None for UNLIMITED / INFINITE. Slurm's formats: M, M:S,
    H:M:S, D-H, D-H:M, D-H:M:S (CaptureError for anything else)."""
    if text.upper() in UNLIMITED:
        return None
    match = _TIME.match(text.strip())
    if not match or not text.strip():
        raise CaptureError(
            f"--time {text!r} is not a Slurm time limit: give minutes, MM:SS, HH:MM:SS, D-HH, "
            "D-HH:MM or D-HH:MM:SS (e.g. 04:00:00), or UNLIMITED"
        )
    days, first, second, third = match.groups()
    if days is not None:
        h, m, s = int(first), int(second or 0), int(third or 0)
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if third is not None:
        return (int(first) * 60 + int(second)) * 60 + int(third)
    return int(first) * 60 + int(second or 0)


def duration(seconds: float) -> str:
    """'3 h 20 min', '12 min', '45 s'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{hours / 24:.1f} days"


def run_time_warning(
    step_seconds: float,
    train_iters: int,
    time_limit: str,
    requeue_lead: int | None,
    basis: str,
) -> str:
    """The warning when `train_iters` steps of `step_seconds` (the cost model's estimate, on
    `basis`) exceed --time `time_limit`; empty when they fit. `requeue_lead`: the seconds before the
    limit at which a --requeue job saves and is requeued (None without --requeue)."""
    limit = time_limit_seconds(time_limit)
    total = step_seconds * train_iters
    if limit is None or total <= limit:
        return ""
    head = (
        f"the cost model estimates {duration(total)} for the {train_iters} iterations "
        f"({step_seconds:.3g} s per step on {basis}), longer than --time {time_limit}"
    )
    if requeue_lead is None:
        return (
            f"{head}: the job will be killed at the time limit. Raise --time, or add --requeue "
            "(with --save) so that the job saves a checkpoint before the limit and is requeued, "
            "resuming from it."
        )
    per_job = max(limit - requeue_lead, 1)
    jobs = math.ceil(total / per_job)
    return (
        f"{head}: with --requeue the job saves a checkpoint {requeue_lead} s before each limit "
        f"and is requeued, resuming from it: about {jobs} runs of the job (each start also pays "
        "start-up and checkpoint loading)."
    )
