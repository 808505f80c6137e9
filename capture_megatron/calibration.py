"""Calibration from measured runs (`verify --refit`): measured / predicted peaks, kept per device.

Each verified run appends one line per pipeline rank to calibration.jsonl in the records cache; the
planner multiplies its predicted peaks by the median measured/predicted ratio of that device before
checking them against the GPU's memory. (On CPU the model is exact and the factor stays ~1; on a GPU
it absorbs what the probes cannot see, e.g. kernel workspaces.)
"""
from __future__ import annotations

import json
import os
import statistics

from capture_megatron.model_source import cache_dir


def _path() -> str:
    return os.path.join(cache_dir(), "calibration.jsonl")


def record(shape, report, rows) -> None:
    """Append the measured vs predicted peaks of a verified run."""
    os.makedirs(cache_dir(), exist_ok=True)
    with open(_path(), "a") as f:
        for c in rows:
            f.write(json.dumps({"device": report.device, "impl": report.transformer_impl, "pp_rank": c.pp_rank,
                                "predicted": c.predicted_bytes, "measured": c.measured_bytes,
                                "layout": report.plan.layout, "hidden": shape.hidden_size}) + "\n")
    print(f"calibration: {len(rows)} rows added to {_path()}; factor now {factor(report.device):.4f}")


def factor(device: str) -> float:
    """Median measured/predicted ratio recorded for `device` (1.0 without records)."""
    if not device or not os.path.exists(_path()):
        return 1.0
    with open(_path()) as f:
        ratios = [r["measured"] / r["predicted"] for r in map(json.loads, f)
                  if r.get("device") == device and r.get("predicted")]
    return statistics.median(ratios) if ratios else 1.0
