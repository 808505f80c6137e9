"""Reading and writing a fitted MemoryModel as JSON (`capture-megatron fit --out`,
`--memory-model`)."""

from __future__ import annotations

import json

from capture_megatron.errors import CaptureError
from capture_megatron.fit.model import MemoryModel
from capture_megatron.serial import from_plain, to_plain


def write_model(model: MemoryModel, path: str) -> None:
    """Write a memory model as JSON."""
    with open(path, "w") as f:
        json.dump(to_plain(model), f)


def read_model(path: str) -> MemoryModel:
    """Read a memory model written by write_model (CaptureError when unreadable)."""
    try:
        with open(path) as f:
            return from_plain(MemoryModel, json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise CaptureError(
            f"cannot read memory model {path}: {err}; fit it again with `capture-megatron fit`"
        ) from None
