"""Every command that writes checks what it writes before it works (issue 56): plan, predict,
verify, launch, preprocess, demo and train (its --save, --memory-report) refuse an output that
cannot be written -- its directory is a file, or it is a directory -- in one paragraph, before
anything is profiled, planned, tokenized or trained. In-process, on the commands' own entry
points; a fresh CAPTURE_MEGATRON_CACHE shows that nothing was profiled."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from capture_megatron.errors import CaptureError

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --vocab-size 128 --micro-batch-size 1 --global-batch-size 2"
).split()
TRAIN = [*MODEL, "--mock-data", "--train-iters", "2", "--no-progress"]


def _argv(command: str, flag: str, bad: str, tmp: Path) -> list[str]:
    corpus = tmp / "corpus.jsonl"
    corpus.write_text('{"text": "a document"}\n')
    return {
        "plan": [*MODEL, "--gpus", "1", "--gpu-memory-gib", "8", "--device", "cpu", flag, bad],
        "predict": [*MODEL, "--gpus", "1", "--device", "cpu", flag, bad],
        "verify": [*MODEL, "--nproc", "1", "--device", "cpu", "--mock-data", flag, bad],
        "launch": [*MODEL, "--nodes", "1", "--gpus-per-node", "1", "--device", "cpu", flag, bad],
        "preprocess": ["--input", str(corpus), flag, bad],
        "demo": [flag, bad],
        "train": ["--nproc", "1", *TRAIN, flag, bad],
    }[command]


CASES = [
    ("plan", "--json"),
    ("plan", "--png"),
    ("predict", "--json"),
    ("predict", "--png"),
    ("verify", "--json"),
    ("verify", "--png"),
    ("verify", "--keep"),
    ("launch", "--sbatch"),
    ("preprocess", "--output-prefix"),
    ("demo", "--workdir"),
    ("train", "--memory-report"),
    ("train", "--save"),
]
DIRECTORIES = {"--keep", "--workdir", "--save"}
"""Flags that name a directory (the rest name a file)."""


@pytest.mark.parametrize("command, flag", CASES, ids=[f"{c}{f}" for c, f in CASES])
def test_an_output_under_a_file_is_refused_before_any_work(command, flag, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "out")
    main = importlib.import_module(f"capture_megatron.cli.{command}").main
    with pytest.raises(CaptureError) as err:
        main(_argv(command, flag, bad, tmp_path))
    text = str(err.value)
    assert text.startswith(f"{flag} {bad}") and "\n" not in text, text
    assert "cannot be created" in text
    assert not (tmp_path / "cache").exists()  # nothing profiled
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "corpus.jsonl"]


@pytest.mark.parametrize("command, flag", [c for c in CASES if c[1] not in DIRECTORIES])
def test_a_directory_where_a_file_goes_is_refused(command, flag, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "taken"
    target.mkdir()
    if flag == "--output-prefix":  # its files are <prefix>_text_document.bin/.idx
        (tmp_path / "taken_text_document.bin").mkdir()
    main = importlib.import_module(f"capture_megatron.cli.{command}").main
    with pytest.raises(CaptureError, match="is a directory: give the file to write"):
        main(_argv(command, flag, str(target), tmp_path))
    assert not (tmp_path / "cache").exists()


def test_a_save_directory_that_is_a_file_is_refused(tmp_path):
    from capture_megatron.cli.train import main

    (tmp_path / "ckpt").write_text("")
    with pytest.raises(CaptureError, match=f"--save {tmp_path / 'ckpt'} is a file, not a dir"):
        main(["--nproc", "1", *TRAIN, "--save", str(tmp_path / "ckpt")])
