"""Before a run reads or writes a checkpoint: the --save directory taken (train.checkpoint.lock),
what a stopped run left there tidied, the resume point chosen, and a start that would replace
checkpoints it did not write refused -- by `capture-megatron train` before torchrun starts
(``preflight``: nothing is changed), and again by the ranks (``claim``, ``protect``: collective;
rank 0 decides and every rank raises the same CaptureError, so no rank waits for one that
failed).
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable

from capture_megatron.config import TrainConfig
from capture_megatron.errors import CaptureError
from capture_megatron.train.checkpoint import trust as ckpt_safe
from capture_megatron.train.checkpoint import verify as ckpt_verify
from capture_megatron.train.checkpoint.directory import (
    PUBLISHING,
    TRACKER,
    Resume,
    choose_resume,
    iteration_dir,
    publishing,
    quick_check,
    recover,
    refuse_replacing,
    set_aside,
    tracked_iteration,
    write_tracker,
)
from capture_megatron.train.checkpoint.lock import SaveLock, check_free


def tidy(root: str) -> list[str]:
    """Rank 0, holding the lock: finish a publish that a stop interrupted (the tracker pointed at
    the complete checkpoint PUBLISHING names), drop the note of one whose checkpoint never
    arrived, and remove the incomplete ``iter_*.partial`` saves of runs that are gone (never a
    checkpoint); returns what was done, in words."""
    notes = []
    recover(root)
    noted = publishing(root)
    if noted is not None:
        try:
            tracked = tracked_iteration(root)
        except CaptureError:
            tracked = None  # the resume names the broken tracker
        if os.path.isdir(iteration_dir(root, noted)) and (tracked is None or noted > tracked):
            write_tracker(root, noted)
            notes.append(
                f"finished publishing iteration {noted}, whose save was stopped after its "
                "checkpoint was complete and before the tracker named it"
            )
    if os.path.exists(os.path.join(root, PUBLISHING)):
        os.remove(os.path.join(root, PUBLISHING))
    partials = sorted(glob.glob(os.path.join(root, "iter_*.partial")))
    for partial in partials:
        shutil.rmtree(partial, ignore_errors=True)
    if partials:
        names = ", ".join(os.path.basename(p) for p in partials)
        notes.append(f"removed the incomplete save {names} of a run that was stopped while saving")
    return [f"--save {root}: {n}." for n in notes]


def agreed(work: Callable[[], str]) -> str:
    """Run `work` on rank 0 and give every rank its outcome: its note, or the CaptureError it
    raised, raised on every rank (collective: call it on all ranks)."""
    import torch

    outcome: list = [("", "")]
    if torch.distributed.get_rank() == 0:
        try:
            outcome = [("", work())]
        except CaptureError as err:
            outcome = [(str(err), "")]
    torch.distributed.broadcast_object_list(outcome, src=0)
    error, note = outcome[0]
    if error:
        raise CaptureError(error)
    return note


def _say(note: str) -> None:
    import torch

    if note and torch.distributed.get_rank() == 0:
        print(f"note: {note}", flush=True)


def claim(cfg: TrainConfig) -> SaveLock | None:
    """Take --save for this run (rank 0 holds the lock; collective), and tidy what a stopped
    run left there; None without --save. Release it when the run ends."""
    import torch

    save = cfg.checkpoint.save
    if not save:
        return None
    lock = SaveLock(save) if torch.distributed.get_rank() == 0 else None

    def take() -> str:
        assert lock is not None, "rank 0 runs it"
        taken = lock.acquire()
        try:
            return " ".join([taken, *tidy(save)]).strip()
        except OSError as err:
            lock.release()
            raise CaptureError(f"--save {save}: cannot tidy it ({err})") from None

    _say(agreed(take))
    return lock


def _start(cfg: TrainConfig, resume: Resume) -> int:
    """The iteration the run starts from."""
    finetune = cfg.checkpoint.finetune
    return 0 if resume.iteration is None or finetune else resume.iteration


def _same_dir(cfg: TrainConfig) -> bool:
    opts = cfg.checkpoint
    same = os.path.realpath(opts.save) == os.path.realpath(opts.load)
    return bool(opts.save and opts.load) and same


def protect(cfg: TrainConfig, resume: Resume) -> None:
    """Refuse a start that would replace complete checkpoints in --save (collective); damaged
    ones in the resumed directory are set aside as iter_N.damaged instead."""
    save = cfg.checkpoint.save
    if not save:
        return
    start = _start(cfg, resume)
    damaged = tuple(d for d in resume.damaged if d > start) if _same_dir(cfg) else ()

    def check() -> str:
        refuse_replacing(save, cfg.checkpoint.load, start, damaged)
        return set_aside(save, damaged)

    _say(agreed(check))


def preflight(cfg: TrainConfig) -> None:
    """Before launching: --save not held by a live run, no checkpoint there a start would
    replace, and the checkpoint a resume starts from (the newest under --load, or --ckpt-step's)
    checked against `cfg` (train.resume). Nothing is changed."""
    from capture_megatron.megatron.schedule import schedule
    from capture_megatron.train.resume import SavedRun, check_resume

    opts = cfg.checkpoint
    if opts.save:
        check_free(opts.save)
    resume = choose_resume(opts.load, step=opts.ckpt_step) if opts.load else Resume(None, "")
    if opts.save:  # damaged ones in the resumed directory: the ranks set them aside
        skip = resume.damaged if _same_dir(cfg) else ()
        refuse_replacing(opts.save, opts.load, _start(cfg, resume), skip)
    if resume.iteration is None:
        return
    path = iteration_dir(opts.load, resume.iteration)
    common = ckpt_safe.load_common(path)
    current = schedule(cfg.optim, cfg.run.train_iters, cfg.plan.global_batch_size)
    check_resume(SavedRun.from_common(path, common), common, cfg, current)


def start_point(cfg: TrainConfig) -> Resume:
    """Where this run starts (collective): the checkpoint --load offers (or --ckpt-step's),
    checked on every rank, with what the choice passed over said once; a start that would
    replace checkpoints in --save refused (claim.protect). Without --load, or when it holds no
    checkpoint, iteration 0, said."""
    from capture_megatron.train.dist_env import is_logging_rank

    opts = cfg.checkpoint
    resume = (
        choose_resume(opts.load, _rank_check, opts.ckpt_step) if opts.load else Resume(None, "")
    )
    if opts.load and resume.iteration is None:
        if opts.exit_on_missing_checkpoint:
            raise CaptureError(f"--load {opts.load}: no checkpoint found ({TRACKER} missing)")
        resume = Resume(
            None, f"--load {opts.load}: no checkpoint there: starting from iteration 0."
        )
    if resume.note and is_logging_rank():
        print(f"note: {resume.note}", flush=True)
    protect(cfg, resume)
    return resume


def _rank_check(directory: str) -> list[str]:
    """Every rank's check of one checkpoint (collective): the launcher's, then the SHA-256 of
    this rank's share of the files; the problems all ranks found, the same list on each."""
    import torch

    problems = quick_check(directory)
    files = ckpt_verify.read_manifest(directory)
    if not problems and files:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        mine = ckpt_verify.share(sorted(files), rank, world)
        problems = ckpt_verify.hash_problems(directory, mine, files)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problems)
    return sorted({p for part in gathered for p in part})
