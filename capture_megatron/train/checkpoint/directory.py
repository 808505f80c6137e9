"""A --save / --load directory in Megatron-LM's layout: ``iter_NNNNNNN/`` per checkpoint and
``latest_checkpointed_iteration.txt`` (the tracker) naming the newest complete one; which
checkpoint a resume starts from (the tracker's, or the newest undamaged one before it:
train.checkpoint.verify), and finishing a replacement a killed save left half-done."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable

from capture_megatron.errors import CaptureError
from capture_megatron.train.checkpoint import trust as ckpt_safe
from capture_megatron.train.checkpoint import verify as ckpt_verify

TRACKER = "latest_checkpointed_iteration.txt"
"""The tracker file: the iteration of the newest complete checkpoint."""
REPLACED = ".replaced"
"""Suffix of a published checkpoint being replaced by a save of the same iteration."""


def iteration_dir(root: str, iteration: int) -> str:
    """Directory of one checkpoint."""
    return os.path.join(root, f"iter_{iteration:07d}")


def recover(root: str, iteration: int | None = None) -> None:
    """Finish what a save killed while replacing a published checkpoint left: put ``iter_N``
    back from ``iter_N.replaced`` when the new one never arrived, else drop the old copy (safe
    to call from several processes at once)."""
    pattern = (
        iteration_dir(root, iteration) if iteration is not None else os.path.join(root, "iter_*")
    )
    for old in glob.glob(pattern + REPLACED):
        final = old[: -len(REPLACED)]
        try:
            if os.path.isdir(final):
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(old, final)
        except OSError:
            pass  # another process got there first


def tracked_iteration(root: str) -> int | None:
    """Iteration named by the tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CaptureError(f"--load {root}: cannot read {TRACKER}: {err}") from None
    if text.isdigit():
        recover(root, int(text))
    if not text.isdigit() or not os.path.isdir(iteration_dir(root, int(text))):
        raise CaptureError(
            f"--load {root}: {TRACKER} says {text[:40]!r} but no such checkpoint directory exists"
        )
    return int(text)


def quick_check(directory: str) -> list[str]:
    """The launcher's check of one checkpoint: sizes, small files' hashes, readable index and
    common state (ckpt_verify.quick_problems, ckpt_safe)."""
    problems = ckpt_verify.quick_problems(directory)
    if problems:
        return problems
    try:
        ckpt_safe.check_metadata(directory)
        ckpt_safe.load_common(directory)
    except CaptureError as err:
        if "could run code" in str(err):
            raise
        return [str(err)]
    return []


def resume_point(
    root: str, check: Callable[[str], list[str]] = quick_check, step: int | None = None
) -> tuple[int | None, str]:
    """(iteration, note): the newest complete checkpoint under `root` (up to the tracker's) whose
    files pass `check`, and the paragraph saying which damaged ones were skipped ('' when none);
    (None, '') without a tracker; CaptureError when every one is damaged. With `step`
    (--ckpt-step) that iteration's checkpoint, as Megatron-LM loads it without reading the
    tracker, or CaptureError when it is missing or damaged (no other one is taken instead)."""
    if step is not None:
        return _chosen_step(root, step, check), ""
    newest = tracked_iteration(root)
    if newest is None:
        return None, ""
    damaged: list[tuple[int, list[str]]] = []
    for it in ckpt_verify.complete_iterations(root, newest):
        problems = check(iteration_dir(root, it))
        if not problems:
            return it, ckpt_verify.fallback_note(root, it, damaged) if damaged else ""
        damaged.append((it, problems))
    raise CaptureError(ckpt_verify.nothing_sound(root, damaged))


def latest_iteration(root: str) -> int | None:
    """The newest complete checkpoint whose sizes and small files match their checksums (cheap:
    for messages; a resume checks more, resume_point), or None."""
    return resume_point(root, ckpt_verify.quick_problems)[0]


def _complete(root: str) -> list[int]:
    """Every published checkpoint's iteration under `root`, newest first."""
    return ckpt_verify.complete_iterations(root, 1 << 62)


def _listed(iterations: list[int]) -> str:
    """Iterations in words, oldest first."""
    return ", ".join(map(str, sorted(iterations))) if iterations else "none"


def _chosen_step(root: str, step: int, check: Callable[[str], list[str]]) -> int:
    """The --ckpt-step checkpoint `step` under `root`, checked by `check`."""
    recover(root, step)
    if step not in _complete(root):
        raise CaptureError(
            f"--load {root} --ckpt-step {step}: there is no complete checkpoint of iteration "
            f"{step} there (complete ones: {_listed(_complete(root))}). Name one of those, or "
            "leave --ckpt-step out to resume from the newest."
        )
    problems = check(iteration_dir(root, step))
    if problems:
        raise CaptureError(
            f"--load {root} --ckpt-step {step}: the checkpoint is damaged "
            f"({ckpt_verify.damage_text(step, problems)}); it is not replaced by another "
            "iteration since --ckpt-step names this one. Restore its files from a copy, or name "
            f"another iteration (complete ones: {_listed(_complete(root))})."
        )
    return step


def refuse_replacing_later(save: str, load: str, step: int | None) -> None:
    """CaptureError when a --ckpt-step resume would save over later checkpoints: --save is the
    --load directory and holds complete checkpoints after `step`, which this run's saves (and the
    tracker) would replace as it reaches their iterations."""
    if step is None or not save or not load or os.path.realpath(save) != os.path.realpath(load):
        return
    later = [it for it in _complete(load) if it > step]
    if later:
        raise CaptureError(
            f"--ckpt-step {step} resumes from iteration {step} of {load}, which also holds later "
            f"checkpoints (iterations {_listed(later)}); saving into the same directory (--save "
            f"{save}) would replace them as this run reaches those iterations, and its tracker "
            "would name this run's newest. Give --save another directory to keep them, or "
            "remove them first."
        )
