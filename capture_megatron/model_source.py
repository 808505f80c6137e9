"""Where the planner's memory model comes from: a given file, or profiled on the spot and cached.

Profiled records are kept per (device, model shape, software versions) under
$CAPTURE_MEGATRON_CACHE (default ~/.cache/capture-megatron); only probes not yet recorded are run,
so a newcomer's first `plan` profiles and later ones reuse the measurements.
"""
from __future__ import annotations

import hashlib
import os

from capture_megatron.config import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, fit
from capture_megatron.profile.records import ProbeShape, Variant, read_records, write_records


def cache_dir() -> str:
    """The records cache directory."""
    return os.environ.get("CAPTURE_MEGATRON_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "capture-megatron")


def _cache_path(shape: ModelShape, device: str) -> str:
    from importlib.metadata import version  # the installed versions, without importing torch/megatron

    from capture_megatron import __version__

    key = f"{device}|{shape.to_json()}|{__version__}|{version('torch')}|{version('megatron-core')}"
    return os.path.join(cache_dir(), f"{device}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.jsonl")


def profiled_model(shape: ModelShape, device: str, needs: set[tuple[Variant, ProbeShape]],
                   progress: bool = True) -> MemoryModel:
    """A memory model holding anchors for every (variant, probe shape) in `needs`."""
    path = _cache_path(shape, device)
    records = read_records(path) if os.path.exists(path) else []
    have = {(r.variant, r.shape) for r in records}
    missing = sorted(((v, s) for v, s in needs if (v, s) not in have), key=str)
    if missing:
        from capture_megatron.profile.design import probes_for
        from capture_megatron.profile.session import run_probes

        probes = [p for v, s in missing for p in probes_for(v, [s])]
        print(f"profiling {len(probes)} probes on {device} for {len(missing)} new (variant, size) pairs "
              f"(cached in {path})", flush=True)
        records += run_probes(probes, device, progress=progress)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_records(records, path + ".tmp")
        os.replace(path + ".tmp", path)
    if not records:
        raise CaptureError("nothing to profile: no candidate plan fits the model's shape")
    return fit(records)
