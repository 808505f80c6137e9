"""A --save / --load directory in Megatron-LM's layout: ``iter_NNNNNNN/`` per checkpoint and
``latest_checkpointed_iteration.txt`` (the tracker) naming the newest complete one; which
checkpoint a resume starts from (the tracker's, or the newest undamaged one before it:
train.checkpoint.verify), and what a run may write there.

Nothing a run did not write is deleted or replaced: a save is published only under a name that
does not exist yet (train.checkpoint.save_load), and a run is refused before it starts when --save
already holds complete checkpoints after the iteration it starts from (``refuse_replacing``: its
saves and tracker would replace them). A save writes ``capture_megatron_publishing`` (the
iteration) before it renames its directory into place and removes it after the tracker names it,
so a save stopped between the two is finished, not repeated over: the resume takes that complete
checkpoint. A directory with ``iter_*`` checkpoints and no tracker resumes from the newest sound
one, saying so (Megatron-LM would start from iteration 0 and save over them)."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

from capture_megatron.errors import CaptureError
from capture_megatron.train.checkpoint import trust as ckpt_safe
from capture_megatron.train.checkpoint import verify as ckpt_verify

TRACKER = "latest_checkpointed_iteration.txt"
"""The tracker file: the iteration of the newest complete checkpoint."""
PUBLISHING = "capture_megatron_publishing"
"""The iteration whose checkpoint a save is publishing (present between the rename of its
directory and the tracker's update)."""
REPLACED = ".replaced"
"""Suffix of a published checkpoint an earlier version of capture-megatron set aside while it
replaced it (put back when the replacement never arrived; never deleted)."""
DAMAGED = ".damaged"
"""Suffix under which a damaged checkpoint in the way of this run's saves is kept."""


def iteration_dir(root: str, iteration: int) -> str:
    """Directory of one checkpoint."""
    return os.path.join(root, f"iter_{iteration:07d}")


def recover(root: str, iteration: int | None = None) -> None:
    """Put ``iter_N`` back from ``iter_N.replaced`` (left by an earlier version's save killed
    while it replaced a checkpoint) when ``iter_N`` is missing; an ``iter_N.replaced`` beside an
    ``iter_N`` is left where it is (safe to call from several processes at once)."""
    pattern = (
        iteration_dir(root, iteration) if iteration is not None else os.path.join(root, "iter_*")
    )
    for old in glob.glob(pattern + REPLACED):
        final = old[: -len(REPLACED)]
        try:
            if not os.path.isdir(final):
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


def publishing(root: str) -> int | None:
    """The iteration a save was publishing when it stopped (PUBLISHING), or None."""
    try:
        with open(os.path.join(root, PUBLISHING), encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def newest_published(root: str) -> tuple[int | None, str]:
    """(iteration, note): the newest checkpoint `root` offers -- the tracker's; a newer one whose
    save stopped between its rename and the tracker's update; without a tracker, the newest
    complete one -- and a note when it is not the tracker's ('' otherwise). (None, '') when there
    is none."""
    tracked = tracked_iteration(root)
    noted = publishing(root)
    newer = noted is not None and (tracked is None or noted > tracked)
    if noted is not None and newer and os.path.isdir(iteration_dir(root, noted)):
        return noted, (
            f"--load {root}: the save of iteration {noted} was stopped after its checkpoint "
            f"was complete and before {TRACKER} named it"
            + (f" (it names {tracked})" if tracked is not None else "")
            + f": resuming from iteration {noted}."
        )
    if tracked is not None:
        return tracked, ""
    complete = _complete(root)
    if not complete:
        return None, ""
    return complete[0], (
        f"--load {root} has no {TRACKER} but holds complete checkpoints (iterations "
        f"{_listed(complete)}): resuming from the newest whose files are sound (stock Megatron-LM "
        "would start from iteration 0 and save over them)."
    )


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


@dataclass(frozen=True)
class Resume:
    """Where a resume starts, and what it passed over."""

    iteration: int | None
    """The checkpoint it loads (None: there is none; the run starts from iteration 0)."""
    note: str
    """What the run prints about the choice ('' when it is simply the tracker's)."""
    damaged: tuple[int, ...] = ()
    """Newer checkpoints skipped as damaged, newest first."""


def choose_resume(
    root: str, check: Callable[[str], list[str]] = quick_check, step: int | None = None
) -> Resume:
    """The newest checkpoint under `root` (newest_published) whose files pass `check`, falling
    back past damaged ones with a note naming them; CaptureError when every one is damaged. With
    `step` (--ckpt-step) that iteration's checkpoint, as Megatron-LM loads it without reading the
    tracker, or CaptureError when it is missing or damaged (no other one is taken instead)."""
    if step is not None:
        return Resume(_chosen_step(root, step, check), "")
    newest, why = newest_published(root)
    if newest is None:
        return Resume(None, "")
    damaged: list[tuple[int, list[str]]] = []
    for it in ckpt_verify.complete_iterations(root, newest):
        problems = check(iteration_dir(root, it))
        if not problems:
            notes = [why, ckpt_verify.fallback_note(root, it, damaged) if damaged else ""]
            return Resume(it, " ".join(n for n in notes if n), tuple(d for d, _ in damaged))
        damaged.append((it, problems))
    raise CaptureError(ckpt_verify.nothing_sound(root, damaged))


def resume_point(
    root: str, check: Callable[[str], list[str]] = quick_check, step: int | None = None
) -> tuple[int | None, str]:
    """(iteration, note) of choose_resume: (None, '') when `root` holds no checkpoint."""
    chosen = choose_resume(root, check, step)
    return chosen.iteration, chosen.note


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


def later_checkpoints(save: str, start: int) -> list[int]:
    """Complete checkpoints under `save` after iteration `start`, oldest first."""
    return sorted(it for it in _complete(save) if it > start) if save else []


def refuse_replacing(save: str, load: str, start: int, skip: tuple[int, ...] = ()) -> None:
    """CaptureError when --save holds complete checkpoints after iteration `start`, where this
    run starts: its saves would replace them as it reaches their iterations, and its tracker
    would name its own newest (a rollback, --ckpt-step, a fresh start or a finetune into a
    directory of another run's checkpoints). `skip`: damaged ones the run sets aside first."""
    later = [it for it in later_checkpoints(save, start) if it not in skip]
    if not later:
        return
    same = bool(load) and os.path.realpath(save) == os.path.realpath(load)
    if same:
        origin = f"resumes from iteration {start} of {load}"
        advice = (
            f"To resume from iteration {later[-1]} instead, leave --ckpt-step out or write "
            f"{later[-1]} into {os.path.join(save, TRACKER)}; to go on from iteration {start}, "
            f"move the later iter_* directories out of {save} or give --save another directory."
        )
    else:
        origin = (
            f"starts from iteration {start} of --load {load}"
            if start
            else "starts from iteration 0 (without --load, with --finetune, or --load found "
            "nothing)"
        )
        advice = (
            f"Give --load {save} to resume from them, give --save another directory, or move "
            f"them out of {save} first."
        )
    raise CaptureError(
        f"this run {origin}, but --save {save} already holds complete checkpoints after it "
        f"(iterations {_listed(later)}): its saves would replace them as it reaches those "
        "iterations and its tracker would name its own newest, so they would be lost. Nothing "
        f"was changed. {advice}"
    )


def set_aside(root: str, iterations: tuple[int, ...]) -> str:
    """Rename the damaged checkpoints `iterations` under `root` to ``iter_N.damaged`` (never
    over an existing name), out of the way of this run's saves; the note naming them ('' when
    none)."""
    kept = []
    for it in sorted(iterations):
        src = iteration_dir(root, it)
        if not os.path.isdir(src):
            continue
        dst, n = src + DAMAGED, 1
        while os.path.exists(dst):
            n += 1
            dst = f"{src}{DAMAGED}.{n}"
        os.rename(src, dst)
        kept.append(os.path.basename(dst))
    if not kept:
        return ""
    return (
        f"--save {root}: the damaged checkpoint{'s' if len(kept) > 1 else ''} after the resumed "
        f"one {'are' if len(kept) > 1 else 'is'} kept for inspection as {', '.join(kept)}, out "
        "of the way of this run's saves."
    )


def write_tracker(root: str, iteration: int) -> None:
    """Point the tracker at `iteration` atomically (write, fsync, rename, fsync the directory)."""
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    fsync_dir(root)


def fsync_dir(path: str) -> None:
    """Make a directory's renames durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_lines(save: str, load: str) -> list[str]:
    """What a stopped or failed run leaves to resume from, in words: the last complete
    checkpoint under --save (or that there is none, or no --save)."""
    lines = []
    if load and load != save:
        lines.append(
            f"The run started from --load {load}: an error above about a checkpoint there is "
            f"about {load}, not --save."
        )
    if not save:
        return lines + [
            "No --save was given, so nothing can be resumed; add --save DIR --save-interval N."
        ]
    try:
        last = latest_iteration(save)
    except CaptureError as err:
        return lines + [str(err)]
    if last is None:
        return lines + [f"No complete checkpoint under {save}: a rerun starts from scratch."]
    return lines + [
        f"The last complete checkpoint is iteration {last} in {save}: rerun the same command "
        f"with --load {save} to resume from it."
    ]
