"""Answers kept between runs (capture_megatron.api.kept): a request asked again is read back equal
to the answer worked out; a new record, other code or another request is a new key; a damaged
answer is set aside and worked out again; CAPTURE_MEGATRON_KEEP_PLANS=0 keeps nothing (a tiny
model profiled once on the fake CPU device)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

from capture_megatron.api import kept, plan
from capture_megatron.cli import plan as plan_cli

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("kept")]

FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "300",
    "--global-batch-size", "8", "--tensor-model-parallel-size", "1",
    "--gpus", "2", "--gpu-memory-gib", "4", "--device", "fake-cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A cache holding the tiny model's records (and no kept answer)."""
    root = str(tmp_path_factory.mktemp("profiled"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CAPTURE_MEGATRON_CACHE", root)
        patch.setenv(kept.ENABLE, "0")
        plan(FLAGS)
    assert not os.path.exists(os.path.join(root, kept.FOLDER))
    return root


@pytest.fixture
def cache(profiled: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A copy of the profiled cache (modification times kept), answers kept."""
    root = str(tmp_path / "cache")
    shutil.copytree(profiled, root)
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", root)
    monkeypatch.setenv(kept.ENABLE, "1")
    return root


def _answers(root: str) -> list[str]:
    folder = os.path.join(root, kept.FOLDER)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_a_request_asked_again_is_read_back_equal(cache):
    first = plan(FLAGS)
    assert first.read_back == "" and len(_answers(cache)) == 1
    again = plan(FLAGS)
    assert again.read_back == os.path.join(cache, kept.FOLDER, _answers(cache)[0])
    assert dataclasses.replace(again, read_back="") == first
    assert again.to_json() == first.to_json()
    other = plan([*FLAGS, "--seq-length", "32"])  # another request: worked out, kept beside
    assert other.read_back == "" and len(_answers(cache)) == 2


def test_new_records_or_other_code_are_a_new_key(cache, monkeypatch):
    first = plan(FLAGS)
    with open(os.path.join(cache, "new-records.jsonl"), "w") as f:
        f.write("\n")
    assert plan(FLAGS).read_back == ""  # a file of the cache changed: worked out again
    assert plan(FLAGS).read_back != ""
    monkeypatch.setattr(kept, "code_digest", lambda: "other code")
    again = plan(FLAGS)
    assert again.read_back == "" and again == first
    assert len(_answers(cache)) == 3


def test_a_damaged_answer_is_set_aside_and_worked_out_again(cache, capsys):
    first = plan(FLAGS)
    (name,) = _answers(cache)
    path = os.path.join(cache, kept.FOLDER, name)
    with open(path, "w") as f:
        f.write('{"key": "')
    again = plan(FLAGS)
    assert again == first and "is unusable" in capsys.readouterr().out
    assert os.path.exists(path + ".damaged") and plan(FLAGS).read_back == path


def test_switched_off_nothing_is_kept(cache, monkeypatch):
    monkeypatch.setenv(kept.ENABLE, "0")
    plan(FLAGS)
    assert plan(FLAGS).read_back == "" and _answers(cache) == []


def test_the_command_line_says_it_read_back(cache, capsys):
    plan_cli.main(list(FLAGS))
    first = capsys.readouterr().out.splitlines()
    plan_cli.main(list(FLAGS))
    again = capsys.readouterr().out.splitlines()
    said = [line for line in again if line.startswith("  read back from ")]
    assert len(said) == 1 and "the same request" in said[0]
    assert [line for line in again if line not in said] == first
