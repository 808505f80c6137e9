"""Output files named on a command line (--json, --png, --out), checked before any work is done.

A missing directory is created, as Megatron-LM creates its --save and --tensorboard-dir
directories (os.makedirs): a user who writes `--json runs/plan.json` expects runs/ to appear.
What cannot be written -- a path that is a directory, a parent that is a file, a directory
without write permission -- is one paragraph and exit status 2 up front, never a traceback after
minutes of profiling.
"""

from __future__ import annotations

import argparse
import os

from capture_megatron.errors import CaptureError

OUTPUT_FLAGS = ("json", "png", "out")
"""Namespace attributes that name a file a command writes."""


def writable(flag: str, path: str) -> None:
    """Create `path`'s directory if it is missing; CaptureError when the file cannot be written."""
    if os.path.isdir(path):
        raise CaptureError(f"{flag} {path} is a directory: give the file to write")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise CaptureError(
            f"{flag} {path}: its directory {parent} cannot be created ({err.strerror})"
        ) from None
    if not os.access(parent, os.W_OK):
        raise CaptureError(f"{flag} {path}: the directory {parent} is not writable")


def prepare_outputs(ns: argparse.Namespace) -> None:
    """Check every output file the command line names (see `writable`), before the work."""
    for name in OUTPUT_FLAGS:
        path = getattr(ns, name, None)
        if isinstance(path, str) and path:
            writable(f"--{name}", path)
