"""Records shipped with the package, read-only and gzipped: the design shapes of the presets'
variants (capture_megatron.profile.design_cache) and the anchors of the models planned most
(ANCHORS), so that a cold plan of one of those starts from their measurements.

An anchors file is a records file of the user's cache (capture_megatron.cache.records_path: the
device, the kernel set, the model shape and the software versions, hashed) as a cold plan wrote
it, under the same name: it is read only where that name -- versions included -- matches
exactly and the user's cache lacks a pair a plan needs; the shipped pairs the cache lacks are
then added to it. The records are the same measurements the plan would make
(bench/ship_anchors.py writes them from cold plans, and lists each file's plans in
ANCHORS/index.json), so the plan is the same, only sooner.
"""

from __future__ import annotations

import functools
import gzip
import os
import tempfile
from importlib import resources

from capture_megatron.records import ProfileRecord, read_records

ANCHORS = "anchors"
"""Folder of capture_megatron.profile holding the shipped anchor records and their index."""
SWITCH = "CAPTURE_MEGATRON_SHIPPED"
"""The environment variable that, set to 0, leaves the shipped records unread (benchmarks of
profiling from nothing; bench/ship_anchors.py)."""


def read_shipped(folder: str, name: str) -> tuple[ProfileRecord, ...] | None:
    """The records of `folder`/`name`.jsonl.gz in capture_megatron.profile, else None (also
    where CAPTURE_MEGATRON_SHIPPED is 0: everything is measured on the spot)."""
    return None if os.environ.get(SWITCH) == "0" else _read_shipped(folder, name)


@functools.lru_cache(maxsize=8)
def _read_shipped(folder: str, name: str) -> tuple[ProfileRecord, ...] | None:
    # read once per process: a lazy search asks again each profiling round
    shipped = resources.files("capture_megatron.profile").joinpath(folder, name + ".jsonl.gz")
    if not shipped.is_file():
        return None
    with tempfile.TemporaryDirectory(prefix="capture-megatron-") as tmp:
        plain = os.path.join(tmp, "records.jsonl")
        with open(plain, "wb") as f:
            f.write(gzip.decompress(shipped.read_bytes()))
        return tuple(read_records(plain))


def shipped_anchors(path: str) -> tuple[ProfileRecord, ...]:
    """The shipped records of the records file `path` (by its name); none when the package ships
    no such file."""
    return read_shipped(ANCHORS, os.path.basename(path).removesuffix(".jsonl")) or ()
