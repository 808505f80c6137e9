"""Answers kept between runs: a plan (or prediction) asked again is read back, not searched again.

A request profiled on the spot (no --memory-model, no memory model passed in) is answered by a
pure function of what it asks (the model, the cluster, the options), the records it is predicted
from and the code that predicts. After planning, the answer is written to
$CAPTURE_MEGATRON_CACHE/plans/<key>.json, the key a SHA-256 of all of those:

- the request: the model shape, the cluster and the plan options (calibration included), as JSON;
- the memory model's device and kernel set, the installed torch, megatron-core and Python, and the
  Transformer Engine the forecast assumes (config.versions.transformer_engine);
- the code: every file of the installed capture_megatron package (its shipped records included);
- the records: every file of the cache outside plans/ (name, size, modification time), so that a
  record profiled, re-profiled, set aside or deleted since, for any model, is a new key; and
  whether the shipped records are read ($CAPTURE_MEGATRON_SHIPPED).

The same key later reads the answer back: JSON rebuilt into the same frozen dataclasses
(capture_megatron.serial; no pickle, nothing in the file is run), equal to the one planned. A file
that cannot be read is set aside and the request planned again. CAPTURE_MEGATRON_KEEP_PLANS=0 turns
keeping and reading back off (the test suite runs so); the newest KEEP answers are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
from importlib.metadata import version

from capture_megatron.api.request import Request
from capture_megatron.cache import cache_dir, set_aside
from capture_megatron.config import versions
from capture_megatron.planner import PlanResult
from capture_megatron.profile.shipped import SWITCH
from capture_megatron.serial import from_plain, to_plain

FOLDER = "plans"
"""The cache's folder of kept answers."""
KEEP = 256
"""Answers kept at most: the oldest beyond them are deleted when one is written."""
ENABLE = "CAPTURE_MEGATRON_KEEP_PLANS"
"""Environment variable: 0 neither reads back nor keeps answers."""


def enabled() -> bool:
    """Whether answers are kept and read back."""
    return os.environ.get(ENABLE, "1") != "0"


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 over the installed package's files (relative path and bytes), bytecode aside."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def records_listing() -> list[tuple[str, int, int]]:
    """(relative path, size, modification time in ns) of every file of the cache outside plans/,
    sorted."""
    root, rows = cache_dir(), []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (folder == root and d == FOLDER)]
        for name in files:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:  # removed while listed (another run setting a file aside)
                continue
            rows.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns))
    return sorted(rows)


def key_of(request: Request, device: str, kernels: str) -> str:
    """The key of `request`'s answer on `device` with kernel set `kernels`, as things are now."""
    material = {
        "request": to_plain((request.shape, request.cluster, request.options)),
        "device": device,
        "kernels": kernels,
        "software": [version("torch"), version("megatron-core"), versions.transformer_engine()],
        "python": platform.python_version(),
        "code": code_digest(),
        "shipped": os.environ.get(SWITCH, ""),
        "records": records_listing(),
    }
    text = json.dumps(material, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _path(key: str) -> str:
    return os.path.join(cache_dir(), FOLDER, key + ".json")


def read_back(key: str) -> PlanResult | None:
    """The answer kept under `key` (read_back set to its file), or None. A file that cannot be
    read as one is set aside, with a note."""
    path = _path(key)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            kept = json.load(f)
        if kept.get("key") != key:
            raise ValueError("its key is not its name")
        result = from_plain(PlanResult, kept["result"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        print(f"note: {set_aside(path, err)}")
        return None
    return dataclasses.replace(result, read_back=path)


def keep(key: str, result: PlanResult) -> None:
    """Write `result` under `key` (atomically), then delete the oldest answers beyond KEEP. A
    cache that cannot be written keeps nothing, silently: the answer was given."""
    folder = os.path.join(cache_dir(), FOLDER)
    path = _path(key)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"key": key, "saved": time.time(), "result": to_plain(result)}, f)
        os.replace(tmp, path)
        kept = sorted(
            (os.path.getmtime(p), p)
            for p in (os.path.join(folder, n) for n in os.listdir(folder))
            if p.endswith(".json")
        )
        for _, old in kept[:-KEEP]:
            os.remove(old)
    except OSError:
        return
