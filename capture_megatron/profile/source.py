"""A ModelSource that profiles on the spot: the memory model a plan needs, profiled for its
(variant, probe shape) pairs and cached.

Records are kept per (device, model shape, software versions) in the cache
(capture_megatron.cache); only probes not yet recorded are run, so a newcomer's first `plan`
profiles and later ones reuse the measurements.
"""

from __future__ import annotations

import os

from capture_megatron.cache import check_writable, records_path
from capture_megatron.config import Kernels, ModelShape
from capture_megatron.config.kernels import kernel_set
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, ModelSource, Needs, fit
from capture_megatron.profile.options import device_name
from capture_megatron.records import ProfileRecord, read_records, write_records


def default_device(requested: str = "") -> str:
    """The device to profile on: `requested` (its canonical name), else cuda when usable, else
    fake-cuda (the GPU kernel set on fake CUDA tensors: what GPU clusters run)."""
    if requested:
        return device_name(requested)
    if not _nvidia_driver():  # no driver, no CUDA: skip importing torch (3 s) to find that out
        return "fake-cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "fake-cuda"


def _nvidia_driver() -> bool:
    """Whether this machine shows an NVIDIA driver (its device nodes or its proc entry)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def profiled_model(
    shape: ModelShape, device: str, kernels: Kernels, needs: Needs, progress: bool = True
) -> MemoryModel:
    """A memory model of `kernels` on `device` holding anchors for every (variant, probe shape)
    in `needs`."""
    path = records_path(shape, device, kernel_set(device, kernels))
    records = _cached(path)
    have = {(r.variant, r.shape) for r in records}
    missing = sorted(((v, s) for v, s in needs if (v, s) not in have), key=str)
    if missing:
        check_writable(os.path.dirname(path))
        from capture_megatron.profile.design import probes_for
        from capture_megatron.profile.session import run_probes

        probes = [p for v, s in missing for p in probes_for(v, [s])]
        print(
            f"profiling {len(probes)} probes on {device} ({kernel_set(device, kernels)}) for "
            f"{len(missing)} new (variant, size) "
            f"pairs (cached in {path})",
            flush=True,
        )
        records += run_probes(probes, device, kernels, progress=progress)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"  # concurrent planners of one model never share a tmp
        write_records(records, tmp)
        os.replace(tmp, path)
    if not records:
        raise CaptureError("nothing to profile: no candidate plan fits the model's shape")
    return fit(records)


def _cached(path: str) -> list[ProfileRecord]:
    """The cached records of a model; none when the file is absent or unreadable (a damaged
    cache entry is profiled again and replaced, with a note)."""
    if not os.path.exists(path):
        return []
    try:
        return read_records(path)
    except CaptureError as err:
        print(f"note: the cached records are unusable ({err}); profiling again", flush=True)
        return []


def memory_source(
    shape: ModelShape, device: str = "", progress: bool = True, kernels: Kernels = Kernels()
) -> ModelSource:
    """The ModelSource for plan(): profile `shape` with `kernels` on `device` (default_device) on
    demand, cached."""
    resolved = default_device(device)

    def source(needs: Needs) -> MemoryModel:
        return profiled_model(shape, resolved, kernels, needs, progress)

    return source
