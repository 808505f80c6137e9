"""Damaged or unusable files are one paragraph naming the file, never a traceback (issue 29, items
6 and 7): calibration.jsonl (truncated, non-UTF-8, a measured 0 or negative peak), records and plan
files that are not UTF-8, a cache directory that cannot be written (refused before profiling, so
no measurement is thrown away), and a damaged cache entry (set aside as <file>.damaged, named in a
note, and profiled again)."""

from __future__ import annotations

import json
import os

import pytest

from capture_megatron import cache
from capture_megatron.cache import Calibration, calibration_factor, check_writable
from capture_megatron.errors import CaptureError
from capture_megatron.planner import read_plan
from capture_megatron.records import read_records

ROW = {"device": "cuda", "impl": "local", "pp_rank": 0, "predicted": 100, "measured": 110}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "text, problem",
    [
        (json.dumps(ROW) + "\n" + json.dumps(ROW)[:20], "line 2 is not a calibration row"),
        (json.dumps({**ROW, "measured": 0}), "measured 0 is not a positive byte count"),
        (json.dumps({**ROW, "predicted": -5}), "predicted -5 is not a positive byte count"),
        (json.dumps({**ROW, "measured": "lots"}), "measured 'lots' is not a positive byte"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_bad_calibration_rows_are_named(cache_dir, text, problem):
    (cache_dir / "calibration.jsonl").write_text(text + "\n")
    with pytest.raises(CaptureError, match="calibration file .*calibration.jsonl") as err:
        calibration_factor("cuda")
    assert problem in str(err.value)


def test_calibration_of_sound_rows_and_other_devices(cache_dir):
    other = {**ROW, "device": "cpu", "measured": 300}
    (cache_dir / "calibration.jsonl").write_text(f"{json.dumps(ROW)}\n\n{json.dumps(other)}\n")
    assert calibration_factor("cuda") == pytest.approx(1.1)
    (cache_dir / "calibration.jsonl").write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(CaptureError, match="UnicodeDecodeError"):
        calibration_factor("cuda")


def test_nonsense_calibration_is_never_recorded(cache_dir):
    row = Calibration("cuda", "local", 0, 100, 0, "Et|tL", 64)
    with pytest.raises(CaptureError, match="calibration rows need positive peaks"):
        cache.record_calibration([row])
    assert not (cache_dir / "calibration.jsonl").exists()


def test_non_utf8_records_and_plan_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x80\x81\x82 not text")
    with pytest.raises(CaptureError, match="is not UTF-8 text"):
        read_records(str(bad))
    with pytest.raises(CaptureError, match=f"--plan-json {bad} is not UTF-8 text"):
        read_plan(str(bad))


def test_a_cache_that_cannot_be_written_is_refused_before_profiling(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CaptureError, match="is not writable .*Set CAPTURE_MEGATRON_CACHE"):
        check_writable(str(blocker / "cache"))
    check_writable(str(tmp_path / "fine" / "cache"))  # created


def test_a_damaged_cache_entry_is_profiled_again(tmp_path, capsys):
    from capture_megatron.profile.source import _cached

    entry = tmp_path / "cpu-0123.jsonl"
    entry.write_bytes(b'{"capture_megatron_records": 1, "ver')
    assert _cached(str(entry)) == []
    note = capsys.readouterr().out
    assert (
        f"the cache file {entry} is unusable" in note
        and "set aside as cpu-0123.jsonl.damaged" in note
    )
    assert not entry.exists() and (tmp_path / "cpu-0123.jsonl.damaged").exists()


def test_design_records_cache_failures_are_notes(tmp_path, monkeypatch, capsys):
    from capture_megatron.profile.design_cache import _cached, load_design, store_design

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(blocker))
    store_design("abc", [])  # cannot be cached: a note, and the caller keeps its records
    assert "could not cache the design records" in capsys.readouterr().out
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path / "cache"))
    damaged = _cached("nokey")
    os.makedirs(os.path.dirname(damaged))
    with open(damaged, "wb") as f:
        f.write(b"\xff\xfe truncated")
    assert load_design("nokey") is None
    assert f"the cache file {damaged} is unusable" in capsys.readouterr().out
    assert os.path.exists(damaged + ".damaged")
