"""Design-shape records shared by every model of a variant, cached and shipped.

The design shapes (capture_megatron.profile.design) do not depend on the model: only on the
variant (dtype, recompute, SP, MLP and norm kinds, ...), the TP sizes probed, the device and kernel
set, whether timelines are recorded, and the software versions. So they are profiled once per such
key and kept in $CAPTURE_MEGATRON_CACHE/design/; the package also ships them for the variants of
its presets on the default GPU kernel set (capture_megatron/profile/design/*.jsonl.gz, written by
bench/ship_design.py with the pinned torch and megatron-core), so that a new model's `profile`
runs only its own (anchor) probes. A shipped file is used only when its key -- versions included --
matches exactly; otherwise the probes run as before and are cached.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import version

from capture_megatron.cache import cache_dir, set_aside
from capture_megatron.errors import CaptureError
from capture_megatron.profile.shipped import read_shipped
from capture_megatron.records import ProfileRecord, Variant, read_records, write_records
from capture_megatron.serial import to_plain
from capture_megatron.version import PROBE_REVISION, __version__

SHIPPED = "design"
"""Folder of capture_megatron.profile holding the shipped design records."""


def design_key(
    device: str, kernel_set: str, variant: Variant, tps: tuple[int, ...], timelines: bool
) -> str:
    """The file name (without suffix) of one variant's design records."""
    soft = f"{__version__}|{version('torch')}|{version('megatron-core')}"
    plain = to_plain(variant)
    if not variant.recompute_modules:  # the default modules: the key the variant had before them
        del plain["recompute_modules"]
    key = f"{device}|{kernel_set}|{json.dumps(plain)}|{tps}|{timelines}|{soft}"
    return f"{device}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def _cached(name: str) -> str:
    # the folder names the probe revision: what an earlier build of this version cached is not read
    return os.path.join(cache_dir(), f"design-r{PROBE_REVISION}", name + ".jsonl")


def load_design(name: str) -> list[ProfileRecord] | None:
    """The design records of key `name` from the cache or the package, else None."""
    path = _cached(name)
    if os.path.exists(path):
        try:
            return read_records(path)
        except CaptureError as err:  # a damaged cache entry: set aside and measured again
            print(f"note: {set_aside(path, err)}")
    shipped = read_shipped(SHIPPED, name)
    return None if shipped is None else list(shipped)


def store_design(name: str, records: list[ProfileRecord]) -> None:
    """Cache the design records of key `name`."""
    path = _cached(name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_records(records, f"{path}.{os.getpid()}.tmp")
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except OSError as err:  # the records are returned all the same; only the cache misses them
        print(
            f"note: could not cache the design records in {os.path.dirname(path)} "
            f"({err.strerror}); they are measured again next time (set CAPTURE_MEGATRON_CACHE "
            "to a writable directory)"
        )
