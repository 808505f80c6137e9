"""What a run may do in its --save directory and where a resume starts (issue 56), on directories
laid out as saves leave them (train.checkpoint.directory, claim, verify): nothing the run did not
write is replaced or deleted, a --load that finds nothing or finds no tracker says so, a save
stopped mid-publish is finished rather than repeated over, and a failed save names its cause as it
is. The end-to-end runs are in tests/dist/test_checkpoint_integrity.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_checkpoint_dirs import _by_hash, _checkpoint

from capture_megatron.errors import CaptureError
from capture_megatron.train.checkpoint import verify as ckpt_verify
from capture_megatron.train.checkpoint.claim import tidy
from capture_megatron.train.checkpoint.directory import (
    PUBLISHING,
    TRACKER,
    choose_resume,
    refuse_replacing,
    resume_point,
    saved_lines,
    set_aside,
)


def _manifests(root: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in root.glob("iter_*/" + ckpt_verify.MANIFEST)}


def test_iterations_without_a_tracker_resume_from_the_newest_sound_one(tmp_path):
    for it in (2, 4, 6):
        _checkpoint(tmp_path, it)
    resume = choose_resume(str(tmp_path), _by_hash)
    assert resume.iteration == 6
    assert f"has no {TRACKER} but holds complete checkpoints (iterations 2, 4, 6)" in resume.note
    assert "stock Megatron-LM would start from iteration 0 and save over them" in resume.note
    (tmp_path / "iter_0000006" / "__0_0.distcp").write_bytes(b"x" * 700)
    resume = choose_resume(str(tmp_path), _by_hash)
    assert (resume.iteration, resume.damaged) == (4, (6,))
    assert "Resuming from iteration 4" in resume.note


def test_a_directory_without_checkpoints_offers_none(tmp_path):
    assert resume_point(str(tmp_path / "missing")) == (None, "")
    (tmp_path / "iter_0000002.partial").mkdir()  # a save that never finished is no checkpoint
    assert resume_point(str(tmp_path)) == (None, "")


def test_a_save_stopped_between_rename_and_tracker_is_resumed_not_repeated(tmp_path):
    for it in (2, 4):
        _checkpoint(tmp_path, it)
    (tmp_path / TRACKER).write_text("2")
    (tmp_path / PUBLISHING).write_text("4")
    resume = choose_resume(str(tmp_path), _by_hash)
    assert resume.iteration == 4 and "was stopped after its checkpoint was complete" in resume.note
    refuse_replacing(str(tmp_path), str(tmp_path), 4)  # nothing after the resumed one
    notes = tidy(str(tmp_path))  # the run that takes the directory finishes the publish
    assert (tmp_path / TRACKER).read_text() == "4" and not (tmp_path / PUBLISHING).exists()
    assert "finished publishing iteration 4" in notes[0]


def test_a_publish_note_whose_checkpoint_never_arrived_is_dropped(tmp_path):
    _checkpoint(tmp_path, 2)
    (tmp_path / TRACKER).write_text("2")
    (tmp_path / PUBLISHING).write_text("4")  # killed before the rename: no iter_4
    assert choose_resume(str(tmp_path), _by_hash).iteration == 2
    (tmp_path / "iter_0000004.partial").mkdir()
    notes = tidy(str(tmp_path))
    assert not (tmp_path / PUBLISHING).exists() and not (tmp_path / "iter_0000004.partial").exists()
    assert (tmp_path / TRACKER).read_text() == "2" and (tmp_path / "iter_0000002").is_dir()
    assert notes == [
        f"--save {tmp_path}: removed the incomplete save iter_0000004.partial of a run that was "
        "stopped while saving."
    ]


@pytest.mark.parametrize(
    "load, start, words",
    [
        ("", 0, "starts from iteration 0 (without --load"),
        ("same", 2, "resumes from iteration 2 of"),
        ("other", 2, "starts from iteration 2 of --load"),
    ],
)
def test_a_start_that_would_replace_later_checkpoints_is_refused(tmp_path, load, start, words):
    save = tmp_path / "save"
    for it in (2, 4, 6):
        _checkpoint(save, it)
    (save / TRACKER).write_text("6")
    before = _manifests(save)
    where = {"": "", "same": str(save), "other": str(tmp_path / "other")}[load]
    with pytest.raises(CaptureError) as err:
        refuse_replacing(str(save), where, start)
    text = str(err.value)
    assert words in text and "Nothing was changed" in text and "\n" not in text
    later = "iterations 2, 4, 6" if start == 0 else "iterations 4, 6"
    assert f"already holds complete checkpoints after it ({later})" in text
    if load == "same":
        assert f"write 6 into {save / TRACKER}" in text
    else:
        assert f"Give --load {save} to resume from them" in text
    assert _manifests(save) == before and (save / TRACKER).read_text() == "6"


def test_the_requeue_pattern_keeps_working(tmp_path):
    # --load D --save D on a first run (D empty or missing), then on the requeued run
    refuse_replacing(str(tmp_path / "D"), str(tmp_path / "D"), 0)
    for it in (2, 4):
        _checkpoint(tmp_path / "D", it)
    (tmp_path / "D" / TRACKER).write_text("4")
    start = choose_resume(str(tmp_path / "D"), _by_hash).iteration
    assert start == 4
    refuse_replacing(str(tmp_path / "D"), str(tmp_path / "D"), start)


def test_damaged_later_checkpoints_are_kept_aside_not_replaced(tmp_path):
    for it in (2, 4, 6):
        _checkpoint(tmp_path, it)
    (tmp_path / TRACKER).write_text("6")
    for it in (4, 6):
        (tmp_path / f"iter_{it:07d}" / "__0_0.distcp").write_bytes(b"x" * 700)
    resume = choose_resume(str(tmp_path), _by_hash)
    assert (resume.iteration, resume.damaged) == (2, (6, 4))
    refuse_replacing(str(tmp_path), str(tmp_path), 2, resume.damaged)
    note = set_aside(str(tmp_path), resume.damaged)
    assert "kept for inspection as iter_0000004.damaged, iter_0000006.damaged" in note
    assert (tmp_path / "iter_0000006.damaged" / "__0_0.distcp").read_bytes() == b"x" * 700
    (tmp_path / "iter_0000004").mkdir()  # a later run damaged 4 again: never over the first
    assert "iter_0000004.damaged.2" in set_aside(str(tmp_path), (4,))


def test_what_survives_a_stopped_run_is_said(tmp_path):
    assert saved_lines("", "") == [
        "No --save was given, so nothing can be resumed; add --save DIR --save-interval N."
    ]
    assert "No complete checkpoint under" in saved_lines(str(tmp_path), "")[0]
    _checkpoint(tmp_path, 2)
    (tmp_path / TRACKER).write_text("2")
    lines = saved_lines(str(tmp_path), str(tmp_path / "elsewhere"))
    assert "an error above about a checkpoint there is about" in lines[0]
    assert f"The last complete checkpoint is iteration 2 in {tmp_path}" in lines[1]


RACE, OWN = "a file of the save was created or removed", "give every run its own --save"
FAILURES = {
    "space": (OSError(errno.ENOSPC, "No space left"), 1 << 20, "no space left", "free space"),
    "permission": (PermissionError(errno.EACCES, "Permission denied"), 1 << 20, "permission", ""),
    "read-only": (OSError(errno.EROFS, "Read-only file system"), 50 << 30, "permission", ""),
    "race-gone": (FileNotFoundError(errno.ENOENT, "No such file"), 1 << 20, RACE, OWN),
    "race-exists": (FileExistsError(errno.EEXIST, "File exists"), 50 << 30, RACE, OWN),
    "zip-full": (RuntimeError("unexpected pos 704 vs 598"), 4096, "no space left", "free space"),
    "other": (RuntimeError("something else"), 50 << 30, "RuntimeError: something", "fix the"),
}


@pytest.mark.parametrize("err, free, cause, advice", FAILURES.values(), ids=FAILURES.keys())
def test_a_failed_save_names_its_cause_as_it_is(err, free, cause, advice):
    wrapped = RuntimeError("CheckpointException ranks:{0}")
    wrapped.__cause__ = err  # megatron-core wraps the writer's error
    text = ckpt_verify.save_error_text("/ck", 6, wrapped, free, 4)
    assert f"saving checkpoint iteration 6 to /ck failed: {cause}" in text, text
    advice = advice or "make /ck writable by this user"
    cause = "permission denied" if cause == "permission" else cause
    assert f"is untouched: {advice}" in text and "\n" not in text
    if cause != "no space left":
        assert "free space" not in text


def test_another_writer_and_a_lost_peer_are_said_as_they_are():
    race = ckpt_verify.race_text("/ck", 4, True)
    assert "another process wrote iter_0000004 there while this run held" in race
    assert "this run's own save stays in iter_0000004.partial" in race
    lost = ckpt_verify.interrupted_text("/ck", 6, 4)
    assert "was interrupted: another rank's process ended" in lost and "iteration 4" in lost


def test_a_file_where_the_tracker_should_be_named(tmp_path):
    _checkpoint(tmp_path, 2)
    (tmp_path / TRACKER).write_text("two")
    with pytest.raises(CaptureError, match="says 'two' but no such checkpoint directory"):
        choose_resume(str(tmp_path), _by_hash)
    os.remove(tmp_path / TRACKER)
    (tmp_path / TRACKER).mkdir()  # a directory in its place: no tracker, the iterations decide
    assert choose_resume(str(tmp_path), _by_hash).iteration == 2
