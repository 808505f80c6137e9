"""torchrun whose ranks start with their imports done: a CPU job's launcher.

`python -m capture_megatron.train.preloaded <torchrun flags> --start-method fork --run-path
<pretrain_gpt.py> <Megatron flags>` imports what a CPU training rank imports (torch, megatron-core's
GPT model, optimizer, schedules and checkpointing, capture-megatron's trainer) and then runs
torchrun's own `main` with the flags as given. torchrun runs a `--run-path` script as a function,
so its `--start-method fork` applies: each rank is forked from this process, with those modules in
memory, instead of starting a Python that imports them again (about 4 s of CPU a rank on a 2-core
machine, most of a short CPU job's time). Everything else is torchrun's: the c10d rendezvous, the
environment each rank reads, the monitoring that stops every rank when one fails, the exit code
(run as train.agent runs it: one paragraph instead of its tracebacks).

Only for ranks without CUDA (a forked process must not inherit an initialised CUDA context, and a
GPU rank compiles megatron-core's fused functions, which a CPU rank does not): `train.launch` uses
it when the machine has no CUDA device. A rank started this way undoes what it inherited from the
launcher that a fresh Python would not have (`entry.forked_rank`).
"""

from __future__ import annotations

import importlib
import os
import sys

from capture_megatron.megatron.lifeline import exit_now

PRETRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "pretrain_gpt.py")
"""The training entry point as a file: what torchrun's --run-path runs in each forked rank."""

PRELOADED = (
    "torch",
    "torch._dynamo",  # torch's optimizers import it on their first add_param_group
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.dist_checkpointing",
    "megatron.core.datasets.gpt_dataset",
    "capture_megatron.train.entry",
    "capture_megatron.train.run",
    "capture_megatron.train.trainer",
    "capture_megatron.train.data",
    "capture_megatron.megatron.builder",
)
"""Modules a CPU rank imports, imported once here before torchrun forks the ranks."""


def preload() -> None:
    """Import PRELOADED the way a rank does: megatron-core's warnings filtered and its fused
    functions eager (both must precede its import; see `entry.main`)."""
    from capture_megatron.emulate import eager_jit
    from capture_megatron.megatron import quiet

    quiet.install()
    eager_jit.install()
    for name in PRELOADED:
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    """Preload, then run torchrun's main with `argv` (default: this process's arguments) as
    train.agent runs it; returns its exit status (a failed job: one paragraph, 1)."""
    preload()
    # a forked rank keeps this process's streams: flush each line as `python -u` ranks would
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    from capture_megatron.train.agent import run

    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    exit_now(main())  # without the teardown of what was preloaded
