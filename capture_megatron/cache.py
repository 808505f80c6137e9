"""What capture-megatron keeps between runs, under $CAPTURE_MEGATRON_CACHE (default
~/.cache/capture-megatron):

- profiled records, one file per (device, model shape, software versions), so that a model's first
  `plan` profiles and later ones reuse the measurements (capture_megatron.profile.source);
- a damaged file among them is set aside (``<file>.damaged``, named in a note) and measured again
  (``set_aside``);
- calibration.jsonl: measured / predicted peaks of verified runs (`verify --refit`), one line per
  pipeline rank. The planner multiplies its predicted peaks by the median ratio of the device
  before checking them against the GPU's memory (on CPU the model is exact and the factor stays
  ~1; on a GPU it absorbs what the probes cannot see, e.g. kernel workspaces).

Pure Python (installed versions are read from package metadata, without importing torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from dataclasses import dataclass
from importlib.metadata import version

from capture_megatron.config import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.version import PROBE_REVISION, __version__


def cache_dir() -> str:
    """The cache directory."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "capture-megatron")
    return os.environ.get("CAPTURE_MEGATRON_CACHE") or default


def check_writable(directory: str) -> None:
    """CaptureError unless `directory` (in the cache) can be created and written: checked before
    profiling, so no measurement is thrown away for want of a place to keep it."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise CaptureError(
            f"the cache directory {directory} is not writable ({err.strerror}): profiling "
            "results could not be kept. Set CAPTURE_MEGATRON_CACHE to a writable directory"
        ) from None


DAMAGED = ".damaged"
"""Suffix under which a damaged cache file is set aside."""


def set_aside(path: str, err: Exception) -> str:
    """Move a damaged cache file out of the way (``<file>.damaged``, never over another) so that
    it is measured again, and say so: the note naming the file, where it went and why. The
    damaged copy stays for inspection; a file that cannot be moved is left (and named)."""
    target, n = path + DAMAGED, 1
    while os.path.exists(target):
        n += 1
        target = f"{path}{DAMAGED}.{n}"
    try:
        os.replace(path, target)
        kept = f"set aside as {os.path.basename(target)}"
    except OSError as move:
        kept = f"left in place ({move.strerror}): it is replaced when the new one is written"
    return f"the cache file {path} is unusable ({err}): {kept}; profiling again"


def records_path(shape: ModelShape, device: str, kernels: str = "cpu") -> str:
    """The records file of a model shape profiled on `device` for a kernel set with the installed
    versions."""
    soft = f"{__version__}|{version('torch')}|{version('megatron-core')}"
    soft += f"|r{PROBE_REVISION}" if PROBE_REVISION > 1 else ""
    key = f"{device}|{kernels}|{shape.to_json()}|{soft}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"{device}-{digest}.jsonl")


def _calibration_path() -> str:
    return os.path.join(cache_dir(), "calibration.jsonl")


@dataclass(frozen=True)
class Calibration:
    """One pipeline rank of a verified run: its predicted and measured peak."""

    device: str
    """cpu or cuda (what the run measured on)."""
    transformer_impl: str
    """local or transformer_engine."""
    pp_rank: int
    """Pipeline rank."""
    predicted: int
    """Predicted peak bytes."""
    measured: int
    """Measured peak bytes."""
    layout: str
    """The run's pipeline layout."""
    hidden: int
    """The model's hidden size."""


def record_calibration(rows: list[Calibration]) -> float:
    """Append the rows to calibration.jsonl; returns the device's factor afterwards."""
    bad = [c for c in rows if c.predicted <= 0 or c.measured <= 0]
    if bad:
        raise CaptureError(
            f"calibration rows need positive peaks; pipeline rank {bad[0].pp_rank} has predicted "
            f"{bad[0].predicted} and measured {bad[0].measured} bytes: nothing was recorded"
        )
    check_writable(cache_dir())
    with open(_calibration_path(), "a") as f:
        for c in rows:
            f.write(
                json.dumps(
                    {
                        "device": c.device,
                        "impl": c.transformer_impl,
                        "pp_rank": c.pp_rank,
                        "predicted": c.predicted,
                        "measured": c.measured,
                        "layout": c.layout,
                        "hidden": c.hidden,
                    }
                )
                + "\n"
            )
    return calibration_factor(rows[0].device) if rows else 1.0


def _ratio(row: object, device: str) -> float | None:
    """measured / predicted of one calibration row of `device` (None: another device's); a
    ValueError for a row that is not one."""
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    if row.get("device") != device:
        return None
    return _byte_count(row, "measured") / _byte_count(row, "predicted")


def _byte_count(row: dict[str, object], name: str) -> int:
    """`row[name]` as a positive byte count; a ValueError for anything else."""
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} {value!r} is not a positive byte count")
    return value


def calibration_factor(device: str) -> float:
    """Median measured/predicted ratio recorded for `device` (1.0 without records); a
    CaptureError naming the file and line of a row that is not a calibration row."""
    path = _calibration_path()
    if not device or not os.path.exists(path):
        return 1.0
    ratios: list[float] = []
    number = 0
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines, start=1):
            number = i
            ratio = _ratio(json.loads(line), device) if line.strip() else None
            ratios += [ratio] if ratio is not None else []
    except (OSError, ValueError) as err:
        raise CaptureError(
            f"calibration file {path} line {number or 1} is not a calibration row "
            f"({type(err).__name__}: {str(err)[:100]}): remove that line (or the file, to drop "
            "every calibration) and verify --refit again"
        ) from None
    return statistics.median(ratios) if ratios else 1.0
