"""Checksums of every file of a checkpoint, and which complete checkpoint a resume may trust.

A save writes ``capture_megatron_checksums.json`` into the checkpoint directory before it is
published: each file's size and SHA-256 ({"format": 1, "files": {name: {"bytes", "sha256"}}}),
hashed by the ranks together (file i by rank i mod world size). A load checks the newest complete
checkpoint against it -- sizes and the few small files the launcher reads before any process starts
(``quick_problems``), every file's hash on the ranks, shared out the same way (``hash_problems``) --
and when anything differs (flipped bytes, a truncated shard, ``.metadata`` or ``common.pt``, a
missing file) it falls back to the previous complete checkpoint, saying so in one paragraph
(``fallback_note``). Checkpoints written without checksums (stock Megatron-LM's, or older ones) are
loaded unverified. Pure Python: no torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Iterator

from capture_megatron.errors import CaptureError

MANIFEST = "capture_megatron_checksums.json"
"""The checksum file inside each checkpoint directory."""
SMALL = (".metadata", "common.pt", "metadata.json")
"""Files read before the ranks start (hashed by the launcher's check too)."""
FULL_BELOW = 64 << 20
"""A failed write with less free space than this (bytes) is reported as a full disk."""
_ITER = re.compile(r"^iter_(\d{7})$")
_CHUNK = 1 << 22


def digest(path: str) -> tuple[int, str]:
    """(bytes, SHA-256 hex) of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def files_to_hash(directory: str) -> list[str]:
    """The checkpoint's files (sorted; the checksum file itself excluded)."""
    return sorted(
        name
        for name in os.listdir(directory)
        if name != MANIFEST and os.path.isfile(os.path.join(directory, name))
    )


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files one rank hashes: every world-th, from its rank on."""
    return names[rank::world]


def digests(directory: str, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of some files of `directory`."""
    out = {}
    for name in names:
        size, sha = digest(os.path.join(directory, name))
        out[name] = {"bytes": size, "sha256": sha}
    return out


def write_manifest(directory: str, files: dict[str, dict]) -> None:
    """Write the checksum file (fsynced) into a finished, not yet published checkpoint."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as f:
        json.dump({"format": 1, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str) -> dict[str, dict] | None:
    """The recorded {name: {"bytes", "sha256"}}; None when the checkpoint has no checksum file.
    A damaged checksum file reads as a checkpoint whose every file is in doubt ({})."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
        return {
            str(k): {"bytes": int(v["bytes"]), "sha256": str(v["sha256"])} for k, v in files.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _size_problem(directory: str, name: str, entry: dict) -> str | None:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        return f"{name} has {size} bytes, {entry['bytes']} were saved (truncated or overwritten)"
    return None


def quick_problems(directory: str) -> list[str]:
    """What is wrong with a checkpoint by its sizes and its small files' hashes (cheap: what the
    launcher checks before starting the ranks); [] when sound or written without checksums."""
    files = read_manifest(directory)
    if files is None:
        return []
    if not files:
        return [f"its checksum file {MANIFEST} is unreadable"]
    problems = [p for n, e in files.items() if (p := _size_problem(directory, n, e))]
    small = [n for n in files if n in SMALL and _size_problem(directory, n, files[n]) is None]
    return problems + hash_problems(directory, small, files)


def hash_problems(
    directory: str, names: list[str], files: dict[str, dict] | None = None
) -> list[str]:
    """Files among `names` whose SHA-256 differs from the recorded one."""
    files = read_manifest(directory) if files is None else files
    problems = []
    for name in names:
        entry = (files or {}).get(name)
        if entry is None:
            continue
        problem = _size_problem(directory, name, entry)
        if problem is None and digest(os.path.join(directory, name))[1] != entry["sha256"]:
            problem = f"{name} does not match its SHA-256 (its bytes changed after the save)"
        if problem:
            problems.append(problem)
    return problems


def complete_iterations(root: str, newest: int) -> list[int]:
    """Iterations of the published checkpoint directories under `root` up to `newest`, newest
    first (``.partial`` saves in progress and ``.replaced`` ones are not complete checkpoints)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER.match(name)
        if m and int(m.group(1)) <= newest and os.path.isdir(os.path.join(root, name)):
            found.append(int(m.group(1)))
    return sorted(found, reverse=True)


def damage_text(iteration: int, problems: list[str]) -> str:
    """One checkpoint's damage, in words."""
    shown = "; ".join(problems[:3]) + (
        f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    )
    return f"iteration {iteration}: {shown}"


def fallback_note(root: str, chosen: int, damaged: list[tuple[int, list[str]]]) -> str:
    """The paragraph a resume prints when it skips damaged checkpoints for `chosen`."""
    skipped = " | ".join(damage_text(it, p) for it, p in damaged)
    newest = damaged[0][0]
    return (
        f"--load {root}: damaged checkpoint{'s' if len(damaged) > 1 else ''} skipped "
        f"({skipped}). Resuming from iteration {chosen}, the "
        f"newest complete checkpoint whose files match their checksums, instead of iteration "
        f"{newest}; the damaged directories stay in place for inspection (delete them, or "
        f"restore them from a copy, to resume from them)."
    )


def nothing_sound(root: str, damaged: list[tuple[int, list[str]]]) -> str:
    """The error when every complete checkpoint under `root` is damaged."""
    return (
        f"--load {root}: no complete checkpoint there can be trusted: "
        + " | ".join(damage_text(it, p) for it, p in damaged)
        + ". Restore the files from a copy, or start without --load."
    )


class SaveError(CaptureError):
    """A checkpoint save failed on this rank (printed by whichever rank raises it)."""

    every_rank = True
    lost_peer = False
    """True when it failed because another rank's process ended."""


def interrupted_text(root: str, iteration: int, last: int | None) -> str:
    """A save interrupted because another rank's process ended (torchrun names which)."""
    kept = (
        f"the last complete checkpoint, iteration {last} in {root}, is untouched"
        if last is not None
        else f"no complete checkpoint is under {root} yet"
    )
    return (
        f"saving checkpoint iteration {iteration} to {root} was interrupted: another rank's "
        f"process ended (torchrun names it). The incomplete iter_{iteration:07d}.partial was "
        f"removed; {kept}."
    )


def _causes(err: BaseException) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and a CheckpointException's per-rank failures."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]


def disk_full(err: BaseException, free: int | None) -> bool:
    """Whether a save failed for want of space: ENOSPC / EDQUOT anywhere in the error, or a
    failed write (torch's zip writer reports a short write as 'unexpected pos') with almost no
    space left and no other cause named."""
    for e in _causes(err):
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(e) or "Disk quota exceeded" in str(e):
            return True
    return cause(err)[0] == "" and free is not None and free < FULL_BELOW


PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
"""Errnos of a write the filesystem does not allow."""
RACE = (errno.EEXIST, errno.ENOENT, errno.ENOTEMPTY)
"""Errnos of a file another process created or removed meanwhile."""


def cause(err: BaseException) -> tuple[str, BaseException]:
    """('permission' | 'race' | '', the exception that says so): a write the filesystem refused,
    a file another process created or removed meanwhile, or neither (then the innermost error
    megatron-core's wrappers hold)."""
    found = list(_causes(err))
    for e in found:
        number = getattr(e, "errno", None)
        if number in PERMISSION or isinstance(e, PermissionError):
            return "permission", e
        if number in RACE or isinstance(e, (FileExistsError, FileNotFoundError)):
            return "race", e
    return "", found[-1]


def race_text(root: str, iteration: int, kept: bool) -> str:
    """A save that found another program's files where only this run writes."""
    name = f"iter_{iteration:07d}"
    return (
        f"saving checkpoint iteration {iteration} to {root} failed: another process wrote "
        f"{name}{'' if kept else '.partial'} there while this run held the directory's lock "
        "(a program that does not take capture-megatron's lock, such as another trainer, saves "
        f"into {root}). Nothing of it was touched"
        + (f"; this run's own save stays in {name}.partial." if kept else ".")
        + " Give every run its own --save directory."
    )


def save_error_text(
    root: str, iteration: int, err: BaseException, free: int | None, last: int | None
) -> str:
    """One paragraph: what failed, why (no space, permission, another writer, or the error as
    it was), what survives and what to do."""
    kind, said = cause(err)
    words = f"{type(said).__name__}: {(str(said).strip().splitlines() or [''])[-1][:300]}"
    if disk_full(err, free):
        why = "no space left on the device" + (
            f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        )
        fix = "free space"
    elif kind == "permission":
        why = f"permission denied ({words})"
        fix = f"make {root} writable by this user (or give --save another directory)"
    elif kind == "race":
        why = (
            f"a file of the save was created or removed by another process meanwhile ({words}): "
            f"another program writes into {root}"
        )
        fix = "give every run its own --save directory"
    else:
        why = words
        fix = "fix the cause"
    survived = (
        f"The last complete checkpoint, iteration {last} in {root}, is untouched: {fix} and "
        f"resume from it with --load {root}."
        if last is not None
        else f"No complete checkpoint is under {root} yet: {fix} and start again."
    )
    return (
        f"saving checkpoint iteration {iteration} to {root} failed: {why}. The incomplete "
        f"iter_{iteration:07d}.partial was removed. {survived}"
    )
