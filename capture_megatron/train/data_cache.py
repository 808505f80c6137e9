"""megatron-core's dataset index caches, read without running code and checked against what was
written.

GPTDataset keeps its document, sample and shuffle indices (``*-document_index.npy``,
``*-sample_index.npy``, ``*-shuffle_index.npy``; BlendedDataset its ``*-dataset_index.npy`` and
``*-dataset_sample_index.npy``) under --data-cache-path, by default next to the corpus, and
megatron-core 0.16.1 loads them with ``numpy.load(path, allow_pickle=True, mmap_mode="r")``, which
unpickles a file that is not an .npy (or an .npy of Python objects): a cache replaced by a pickle
whose ``__reduce__`` calls ``os.system`` ran the command in every training rank. Here:

- ``install()`` gives megatron-core's gpt_dataset and blended_dataset modules a numpy whose
  ``load`` never unpickles (allow_pickle=False: such a file is a CaptureError naming it, never
  code) and whose ``save`` records each index file's size and SHA-256 beside it
  (``<file>.sha256``) right after writing it -- through the patch registry (emulate.patches);
- ``heal(dirs)``, on the process that builds caches (rank 0, holding the build lock, before the
  build): every ``*.npy`` under the cache directories must be an .npy of numbers (its header read
  without pickle), as long as its header says, and equal to its recorded SHA-256 when it has one.
  A file that is not is set aside as ``<file>.damaged`` with a note naming it, and megatron-core
  builds that cache again.

Caches written by stock Megatron-LM (no checksum) are used when they pass the structural check.
The checksums guard against damage, not against someone who can write the cache directory (they
can rewrite the checksum too); what keeps such a person from running code is that nothing is
unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import types
from collections.abc import Iterator
from typing import Any

import numpy

from capture_megatron.config.training import DataOptions
from capture_megatron.emulate import patches
from capture_megatron.errors import CaptureError

LOCK_NAME = ".capture-megatron-build.lock"
"""File locked while index caches are built."""
SUFFIX = ".sha256"
"""The checksum file written beside each index cache."""
DAMAGED = ".damaged"
"""The suffix a damaged index cache is set aside under."""
MODULES = ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset")
"""megatron-core modules that load index caches with allow_pickle=True."""
WHY = "dataset index caches loaded without pickle; their checksums written when saved"
"""The patch registry's reason."""


def digest(path: str) -> dict[str, Any]:
    """{"bytes", "sha256"} of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def record(path: str) -> None:
    """Write `path`'s checksum file (atomically)."""
    tmp = f"{path}{SUFFIX}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(digest(path), f)
    os.replace(tmp, path + SUFFIX)


def _load(file: Any, mmap_mode: Any = None, allow_pickle: bool = False, **kwargs: Any) -> Any:
    """numpy.load that never unpickles (CaptureError naming the file instead)."""
    try:
        return numpy.load(file, mmap_mode=mmap_mode, allow_pickle=False, **kwargs)
    except ValueError as err:
        if "pickle" not in str(err):
            raise
        raise CaptureError(
            f"dataset index cache {file} is not an .npy of numbers (a pickle, or Python "
            "objects): reading it could run code, so it is refused. Delete it (it is built "
            "again), or start the run again to have it set aside and rebuilt."
        ) from None


def _save(file: Any, arr: Any, allow_pickle: bool = True, **kwargs: Any) -> None:
    """numpy.save of an index (numbers only), then its checksum file."""
    numpy.save(file, arr, allow_pickle=False, **kwargs)
    if isinstance(file, (str, os.PathLike)):
        record(os.fspath(file))


class SafeNumpy(types.ModuleType):
    """numpy as megatron-core's dataset modules see it: `load` and `save` above, the rest
    numpy's own."""

    load = staticmethod(_load)
    save = staticmethod(_save)

    def __init__(self) -> None:
        super().__init__("numpy", numpy.__doc__)

    def __getattr__(self, name: str) -> Any:
        return getattr(numpy, name)


def install() -> None:
    """Make megatron-core's dataset modules load index caches without pickle and checksum the
    ones they save (patch registry; idempotent)."""
    import importlib

    if not patches.first("data_cache"):
        return
    safe = SafeNumpy()
    for name in MODULES:
        patches.patch(importlib.import_module(name), "numpy", safe, WHY)


def problem(path: str) -> str:
    """What is wrong with one index cache file ('' when sound): not an .npy of numbers, shorter
    or longer than its header says, or not what was written (its checksum)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            version = numpy.lib.format.read_magic(f)
            read = (
                numpy.lib.format.read_array_header_1_0
                if version == (1, 0)
                else numpy.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(f)
            header = f.tell()
    except (ValueError, OSError, SyntaxError) as err:
        return f"it is not an .npy file ({str(err)[:80]}); reading it could have run code"
    if dtype.hasobject:
        return "it holds Python objects, which reading would unpickle (run code)"
    want = header + int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if size != want:
        return f"it has {size} bytes and its header promises {want} (truncated or overwritten)"
    try:
        with open(path + SUFFIX, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return ""  # no checksum (stock Megatron-LM's cache): the structure has to do
    if digest(path) != saved:
        return f"it does not match the SHA-256 recorded when it was written ({path + SUFFIX})"
    return ""


def _set_aside(path: str) -> str:
    target, n = path + DAMAGED, 1
    while os.path.exists(target):
        n += 1
        target = f"{path}{DAMAGED}.{n}"
    os.rename(path, target)
    if os.path.exists(path + SUFFIX):
        os.remove(path + SUFFIX)
    return target


def heal(dirs: list[str]) -> list[str]:
    """Check every index cache under `dirs` (see `problem`); set aside the damaged ones so that
    megatron-core builds them again. Returns one note per file set aside."""
    notes = []
    for top in dirs:
        for folder, _, names in os.walk(top):
            for name in sorted(n for n in names if n.endswith(".npy")):
                path = os.path.join(folder, name)
                why = problem(path)
                if why:
                    kept = _set_aside(path)
                    notes.append(
                        f"dataset index cache {path}: {why}. Set aside as "
                        f"{os.path.basename(kept)}; building it again."
                    )
    return notes


def cache_dirs(opts: DataOptions, prefixes: list[str]) -> list[str]:
    """Directories GPTDataset writes index caches into."""
    if opts.mock_data:
        return []
    if opts.data_cache_path:
        return [opts.data_cache_path]
    return sorted({os.path.join(p, "cache") for p in prefixes})


@contextlib.contextmanager
def build_lock(dirs: list[str], writer: bool) -> Iterator[None]:
    """Check the cache directories are writable (every rank alike, so no rank waits at a barrier for
    one that failed) and, on the process that writes caches, hold an exclusive lock on each."""
    for d in dirs:
        try:
            os.makedirs(d, exist_ok=True)
            ok = os.access(d, os.W_OK)
        except OSError:
            ok = False
        if not ok:
            raise CaptureError(
                f"cannot write dataset index caches into {d!r}; give a writable --data-cache-path"
            )
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        fcntl = None  # type: ignore[assignment]  # a module or None
    with contextlib.ExitStack() as stack:
        if writer and fcntl is not None:
            for d in dirs:
                f = stack.enter_context(open(os.path.join(d, LOCK_NAME), "a"))
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
                stack.callback(fcntl.flock, f.fileno(), fcntl.LOCK_UN)
        yield
