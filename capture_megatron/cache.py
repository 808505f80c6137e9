"""What capture-megatron keeps between runs, under $CAPTURE_MEGATRON_CACHE (default
~/.cache/capture-megatron):

- profiled records, one file per (device, model shape, software versions), so that a model's first
  `plan` profiles and later ones reuse the measurements (capture_megatron.profile.source);
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

from capture_megatron import __version__
from capture_megatron.config import ModelShape


def cache_dir() -> str:
    """The cache directory."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "capture-megatron")
    return os.environ.get("CAPTURE_MEGATRON_CACHE") or default


def records_path(shape: ModelShape, device: str, kernels: str = "cpu") -> str:
    """The records file of a model shape profiled on `device` for a kernel set with the installed
    versions."""
    soft = f"{__version__}|{version('torch')}|{version('megatron-core')}"
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
    os.makedirs(cache_dir(), exist_ok=True)
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


def calibration_factor(device: str) -> float:
    """Median measured/predicted ratio recorded for `device` (1.0 without records)."""
    path = _calibration_path()
    if not device or not os.path.exists(path):
        return 1.0
    with open(path) as f:
        ratios = [
            r["measured"] / r["predicted"]
            for r in map(json.loads, f)
            if r.get("device") == device and r.get("predicted")
        ]
    return statistics.median(ratios) if ratios else 1.0
