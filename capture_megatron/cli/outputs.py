"""Output files and directories named on a command line, checked before any work is done.

A missing directory is created, as Megatron-LM creates its --save and --tensorboard-dir
directories (os.makedirs): a user who writes `--json runs/plan.json` expects runs/ to appear.
What cannot be written -- a path that is a directory, a parent that is a file, a directory
without write permission -- is one paragraph and exit status 2 up front, never a traceback after
minutes of profiling or training. Every command that writes checks here (plan, predict, profile,
fit, verify, launch, preprocess; train checks --save, --memory-report and --moe-routing-stats in
train.launch before torchrun starts, and its ranks again).
"""

from __future__ import annotations

import argparse

from capture_megatron.serial import writable, writable_dir

__all__ = ["OUTPUT_FLAGS", "prepare_outputs", "writable", "writable_dir"]

OUTPUT_FLAGS = ("json", "png", "out", "sbatch")
"""Namespace attributes that name a file a command writes."""


def prepare_outputs(ns: argparse.Namespace) -> None:
    """Check every output file the command line names (see `writable`), before the work."""
    for name in OUTPUT_FLAGS:
        path = getattr(ns, name, None)
        if isinstance(path, str) and path:
            writable(f"--{name}", path)
