"""Which checkpoint a resume trusts (train.checkpoint.directory, train.checkpoint.verify), on
directories laid out as a save leaves them: checksums, damaged checkpoints skipped, a replacement a
kill interrupted, and the paragraph a failed save prints. The end-to-end runs are in
tests/dist/test_checkpoint_integrity.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from capture_megatron.config import CheckpointOptions
from capture_megatron.errors import CaptureError
from capture_megatron.train.checkpoint import verify as ckpt_verify
from capture_megatron.train.checkpoint.directory import (
    REPLACED,
    TRACKER,
    recover,
    refuse_replacing,
    resume_point,
)


def _checkpoint(root: Path, it: int, payload: bytes = b"weights") -> Path:
    d = root / f"iter_{it:07d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload * 100)
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    names = ckpt_verify.files_to_hash(str(d))
    ckpt_verify.write_manifest(str(d), ckpt_verify.digests(str(d), names))
    return d


def _by_hash(directory: str) -> list[str]:
    return ckpt_verify.hash_problems(directory, ckpt_verify.files_to_hash(directory))


def test_sound_checkpoint_and_its_damage(tmp_path):
    d = _checkpoint(tmp_path, 3)
    assert ckpt_verify.quick_problems(str(d)) == [] and _by_hash(str(d)) == []
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[10] ^= 1
    (d / "__0_0.distcp").write_bytes(bytes(data))
    assert ckpt_verify.quick_problems(str(d)) == []  # same size: only the hash can tell
    assert _by_hash(str(d)) == [
        "__0_0.distcp does not match its SHA-256 (its bytes changed after the save)"
    ]
    (d / "__0_0.distcp").write_bytes(b"short")
    assert ckpt_verify.quick_problems(str(d)) == [
        "__0_0.distcp has 5 bytes, 700 were saved (truncated or overwritten)"
    ]
    (d / "metadata.json").unlink()
    assert "metadata.json is missing" in ckpt_verify.quick_problems(str(d))
    (d / ckpt_verify.MANIFEST).write_bytes(b"\xff\xfe{")
    assert ckpt_verify.quick_problems(str(d)) == [
        f"its checksum file {ckpt_verify.MANIFEST} is unreadable"
    ]


def test_no_checksums_is_loaded_unverified(tmp_path):
    d = _checkpoint(tmp_path, 3)
    (d / ckpt_verify.MANIFEST).unlink()
    assert ckpt_verify.read_manifest(str(d)) is None and ckpt_verify.quick_problems(str(d)) == []


def test_resume_point_falls_back_past_damage(tmp_path):
    for it in (2, 4, 6):
        _checkpoint(tmp_path, it)
    (tmp_path / "iter_0000008.partial").mkdir()  # a save in progress is never a candidate
    (tmp_path / TRACKER).write_text("6")
    assert resume_point(str(tmp_path), _by_hash) == (6, "")
    for it in (6, 4):
        (tmp_path / f"iter_{it:07d}" / "__0_0.distcp").write_bytes(b"x" * 700)
    it, note = resume_point(str(tmp_path), _by_hash)
    assert it == 2
    assert "iteration 6: __0_0.distcp does not match its SHA-256" in note
    assert "Resuming from iteration 2" in note and "instead of iteration 6" in note
    (tmp_path / "iter_0000002" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CaptureError, match="no complete checkpoint there can be trusted"):
        resume_point(str(tmp_path), _by_hash)


def test_ckpt_step_resumes_from_the_named_iteration_or_refuses(tmp_path):
    """--ckpt-step N takes iteration N as Megatron-LM does (the tracker is not read), and never
    another one in its place: a missing or damaged N is one paragraph naming the complete ones."""
    for it in (2, 4, 6):
        _checkpoint(tmp_path, it)
    (tmp_path / "iter_0000008.partial").mkdir()
    assert resume_point(str(tmp_path), _by_hash, step=4) == (4, "")  # no tracker needed
    (tmp_path / TRACKER).write_text("6")
    assert resume_point(str(tmp_path), _by_hash, step=2) == (2, "")
    with pytest.raises(CaptureError, match=r"no complete checkpoint of iteration 8 there "
                       r"\(complete ones: 2, 4, 6\)"):  # fmt: skip
        resume_point(str(tmp_path), _by_hash, step=8)
    (tmp_path / "iter_0000004" / "__0_0.distcp").write_bytes(b"x" * 700)
    with pytest.raises(CaptureError, match="iteration 4: __0_0.distcp does not match") as err:
        resume_point(str(tmp_path), _by_hash, step=4)
    assert "not replaced by another iteration" in str(err.value)
    with pytest.raises(CaptureError, match="complete ones: none"):
        resume_point(str(tmp_path / "empty"), _by_hash, step=1)


def test_a_ckpt_step_resume_never_saves_over_later_checkpoints(tmp_path):
    for it in (2, 4, 6):
        _checkpoint(tmp_path, it)
    root = str(tmp_path)
    with pytest.raises(CaptureError, match=r"after it \(iterations 4, 6\)"):
        refuse_replacing(root, root + "/.", 2)
    refuse_replacing(root, root, 6)  # nothing after it
    refuse_replacing(str(tmp_path / "other"), root, 2)  # saved elsewhere
    with pytest.raises(CaptureError, match="no --load directory"):
        CheckpointOptions(ckpt_step=2).require_trainable()
    CheckpointOptions(load=root, ckpt_step=0).require_trainable()


def test_tracker_problems_are_one_paragraph(tmp_path):
    assert resume_point(str(tmp_path)) == (None, "")
    (tmp_path / TRACKER).write_bytes(b"\xff\xfe")
    with pytest.raises(CaptureError, match=f"cannot read {TRACKER}"):
        resume_point(str(tmp_path))
    (tmp_path / TRACKER).write_text("9")
    with pytest.raises(CaptureError, match="says '9' but no such checkpoint directory exists"):
        resume_point(str(tmp_path))


def test_a_replacement_an_earlier_version_left_is_put_back_never_deleted(tmp_path):
    # killed after iter_4 was set aside and before the new one was renamed into place
    old = _checkpoint(tmp_path, 4)
    os.rename(old, str(old) + REPLACED)
    (tmp_path / TRACKER).write_text("4")
    assert resume_point(str(tmp_path), _by_hash) == (4, "")
    assert old.is_dir() and not Path(str(old) + REPLACED).exists()
    # killed after the new one was renamed into place: the old copy is kept, not deleted
    stale = _checkpoint(tmp_path / "elsewhere", 4)
    os.rename(stale, str(old) + REPLACED)
    recover(str(tmp_path))
    assert old.is_dir() and Path(str(old) + REPLACED).is_dir()


def test_save_failure_texts():
    full = OSError(errno.ENOSPC, "No space left on device")
    text = ckpt_verify.save_error_text("/ck", 6, full, 10 << 20, 4)
    assert "saving checkpoint iteration 6 to /ck failed: no space left on the device" in text
    assert "The last complete checkpoint, iteration 4 in /ck, is untouched" in text
    # torch's zip writer hides the errno ("unexpected pos"): the free space tells
    zipped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert "no space left" in ckpt_verify.save_error_text("/ck", 6, zipped, 4096, None)
    other = ckpt_verify.save_error_text("/ck", 6, zipped, 50 << 30, None)
    assert "RuntimeError: [enforce fail" in other and "No complete checkpoint" in other
