"""Reading a bench's results for bench/report.py's sections."""

from __future__ import annotations

import json
import os


def read_result(root: str, name: str) -> dict | None:
    """bench/results/<name>.json, or None when its bench has not run."""
    path = os.path.join(root, "bench", "results", f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
