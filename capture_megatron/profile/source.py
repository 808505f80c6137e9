"""A ModelSource that profiles on the spot: the memory model a plan needs, profiled for its
(variant, probe shape) pairs and cached.

Records are kept per (device, model shape, software versions) in the cache
(capture_megatron.cache); only probes not yet recorded are run, so a newcomer's first `plan`
profiles and later ones reuse the measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from dataclasses import dataclass

from capture_megatron.cache import check_writable, records_path, set_aside
from capture_megatron.config import Kernels, ModelShape
from capture_megatron.config.kernels import kernel_set
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, Needs, RecordedSource, fit
from capture_megatron.fit.decompose import VariantMemo
from capture_megatron.profile.options import device_name
from capture_megatron.profile.shipped import shipped_anchors
from capture_megatron.records import (
    Probe,
    ProbeShape,
    ProfileRecord,
    Variant,
    read_records,
    write_records,
)
from capture_megatron.serial import JsonMixin
from capture_megatron.version import __version__


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
    in `needs`: the cache's, then the package's (profile.shipped), then profiled."""
    path = records_path(shape, device, kernel_set(device, kernels))
    stat = os.stat(path) if os.path.exists(path) else None
    # a file of another records format (or damaged) is set aside by _read: nothing to fit then
    records = list(_read(path, stat.st_mtime_ns, stat.st_size)) if stat else []
    if records and stat is not None:
        kept = _fitted(path, stat.st_mtime_ns, stat.st_size)
        if needs <= set(kept.pairs):
            return kept.model
    have = {_pair(r) for r in records}
    shipped = [] if needs <= have else [r for r in shipped_anchors(path) if _pair(r) not in have]
    records += shipped
    have |= {_pair(r) for r in shipped}
    missing = sorted(((v, s) for v, s in needs if (v, s) not in have), key=str)
    if missing or shipped:
        check_writable(os.path.dirname(path))
        records += _profiled(missing, records, device, kernels, progress, path) if missing else []
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"  # concurrent planners of one model never share a tmp
        write_records(records, tmp)
        os.replace(tmp, path)
    if not records:
        raise CaptureError("nothing to profile: no candidate plan fits the model's shape")
    st = os.stat(path)  # profiled just now: every pair asked for is in the records kept
    _WRITTEN[path] = (st.st_mtime_ns, st.st_size, tuple(records))  # the next round's _read
    return _keep(path, (st.st_mtime_ns, st.st_size, _code_fingerprint()), records).model


def _profiled(
    missing: list[tuple[Variant, ProbeShape]],
    records: list[ProfileRecord],
    device: str,
    kernels: Kernels,
    progress: bool,
    path: str,
) -> list[ProfileRecord]:
    """The records of the `missing` pairs: their probes run, except those whose chunk a record
    kept already measured (profile.design.built_as: a full-recompute pair's probes without
    recomputed layers are its no-recompute pair's)."""
    from capture_megatron.profile.design import built_as, probes_for
    from capture_megatron.profile.session import run_probes

    probes = [p for v, s in missing for p in probes_for(v, [s])]
    known = {built_as(_probe(r)): r for r in records}
    todo = list(dict.fromkeys(built_as(p) for p in probes if built_as(p) not in known))
    shared = len(probes) - len(todo)
    again = f"{shared} of their probes reuse another's measurement; " if shared else ""
    print(
        f"profiling {len(todo)} probes on {device} ({kernel_set(device, kernels)}) for "
        f"{len(missing)} new (variant, size) pairs ({again}cached in {path})",
        flush=True,
    )
    for record in run_probes(todo, device, kernels, progress=progress) if todo else []:
        known.setdefault(built_as(_probe(record)), record)
    return [dataclasses.replace(known[built_as(p)], variant=p.variant) for p in probes]


def _pair(record: ProfileRecord) -> tuple[Variant, ProbeShape]:
    """The (variant, probe shape) pair a record measures."""
    return record.variant, record.shape


def _probe(record: ProfileRecord) -> Probe:
    """The probe that measured a record."""
    r = record
    return Probe(
        r.variant, r.shape, r.kind, r.layers, r.recompute_layers, r.dp, r.distributed_optimizer
    )


@dataclass(frozen=True)
class KeptFit(JsonMixin):
    """A records file's fitted memory model, kept beside it (`<records>.fit.json`) so that a
    warm `plan` reads the fit instead of reading the records and fitting them again."""

    key: tuple[int, int, str]
    """(the records file's modification time in ns, its size, _code_fingerprint()) it was
    fitted from: any other is fitted again."""
    pairs: tuple[tuple[Variant, ProbeShape], ...]
    """The (variant, probe shape) pairs the records hold."""
    model: MemoryModel
    """The fit."""


@functools.lru_cache(maxsize=4)
def _read(path: str, mtime_ns: int, size: int) -> tuple[ProfileRecord, ...]:
    """The records of a file as it is (its modification time and size name the version): a
    search asks for one file's model several times, read once."""
    written = _WRITTEN.get(path)
    if written is not None and written[:2] == (mtime_ns, size):
        return written[2]  # what this process wrote there: the same objects (_keep's memo)
    return tuple(_cached(path))


_WRITTEN: dict[str, tuple[int, int, tuple[ProfileRecord, ...]]] = {}
"""The records this process last wrote to each records file, by the file's modification time
and size then: a search's next profiling round starts from them instead of reading the file."""
_FITS: dict[str, VariantMemo] = {}
"""Per records file, the variants fitted so far (fit's memo): a profiling round refits only the
variants it added records to."""


@functools.lru_cache(maxsize=4)
def _fitted(path: str, mtime_ns: int, size: int) -> KeptFit:
    """The records file's fit as it is (_read): read from `<records>.fit.json` when it was kept
    for the same records and package code, else fitted and kept (when the cache is writable)."""
    stored, key = f"{path}.fit.json", (mtime_ns, size, _code_fingerprint())
    try:
        with open(stored) as f:
            kept = KeptFit.from_json(f.read())
        if kept.key == key:
            return kept
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, stale or unreadable: fitted again
    return _keep(path, key, list(_read(path, mtime_ns, size)))


def _keep(path: str, key: tuple[int, int, str], records: list[ProfileRecord]) -> KeptFit:
    """The fit of a records file's `records`, written beside it (when the cache is writable)."""
    pairs = tuple(sorted({(r.variant, r.shape) for r in records}, key=str))
    kept = KeptFit(key, pairs, fit(records, _FITS.setdefault(path, {})))
    tmp = f"{path}.fit.json.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(kept.to_json())
        os.replace(tmp, f"{path}.fit.json")
    except OSError:
        pass  # a read-only cache: fitted in each process
    return kept


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """The package's version and its Python files' sizes and modification times, hashed: a
    fit kept by other code is fitted again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256(__version__.encode())
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(n for n in files if n.endswith(".py")):
            st = os.stat(os.path.join(folder, name))
            digest.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def _cached(path: str) -> list[ProfileRecord]:
    """The cached records of a model; none when the file is absent or unreadable (a damaged
    cache entry is set aside, named in a note, and profiled again: cache.set_aside)."""
    if not os.path.exists(path):
        return []
    try:
        return read_records(path)
    except CaptureError as err:
        print(f"note: {set_aside(path, err)}", flush=True)
        return []


@dataclass(frozen=True)
class _Source:
    """memory_source's ModelSource (a RecordedSource)."""

    shape: ModelShape
    """The model profiled."""
    device: str
    """Where (resolved: default_device)."""
    kernels: Kernels
    """With which kernels."""
    progress: bool
    """Whether profiling shows a progress bar."""

    def __call__(self, needs: Needs) -> MemoryModel:
        """profiled_model of `needs`."""
        return profiled_model(self.shape, self.device, self.kernels, needs, self.progress)

    def recorded(self, needs: Needs) -> bool:
        """Whether the records file holds every pair of `needs` already."""
        path = records_path(self.shape, self.device, kernel_set(self.device, self.kernels))
        if not os.path.exists(path):
            return not needs
        st = os.stat(path)
        return needs <= set(_fitted(path, st.st_mtime_ns, st.st_size).pairs)


def memory_source(
    shape: ModelShape, device: str = "", progress: bool = True, kernels: Kernels = Kernels()
) -> RecordedSource:
    """The ModelSource for plan(): profile `shape` with `kernels` on `device` (default_device) on
    demand, cached."""
    return _Source(shape, default_device(device), kernels, progress)
