"""Output files (--json, --png, --out) are checked before any work: a missing directory is
created (as Megatron-LM creates --save and --tensorboard-dir), and a path that cannot be written
is one paragraph with exit status 2 before anything is profiled -- not exit 1 after the work."""

from __future__ import annotations

import json
import os

import pytest
from test_cli_errors import cli, one_error

from capture_megatron.cli.outputs import writable
from capture_megatron.errors import CaptureError

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128 "
    "--micro-batch-size 1 --gpus 1 --device cpu --no-progress"
).split()


def test_missing_directories_are_created(tmp_path):
    target = tmp_path / "runs" / "a" / "plan.json"
    writable("--json", str(target))
    assert target.parent.is_dir() and not target.exists()


@pytest.mark.parametrize("command", ["predict", "plan", "fit", "profile"])
def test_unwritable_outputs_stop_before_any_work(command, tmp_path):
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "out.json")  # its directory is a file
    argv = {
        "predict": [*TINY, "--json", bad],
        "plan": [*TINY, "--gpu-memory-gib", "8", "--png", bad],
        "fit": [str(tmp_path / "missing.jsonl"), "--out", bad],
        "profile": [*TINY[:10], "--device", "cpu", "--out", bad],
    }[command]
    line = one_error(cli([command, *argv], str(tmp_path)), command)
    assert f"{bad}: its directory {tmp_path / 'a-file'} cannot be created" in line, line
    with pytest.raises(CaptureError, match="is a directory"):
        writable("--json", str(tmp_path))


@pytest.mark.slow
def test_predict_writes_json_and_png_into_a_new_directory(tmp_path):
    out = tmp_path / "new" / "deeper"
    argv = ["predict", *TINY, "--json", str(out / "p.json"), "--png", str(out / "p.png")]
    done = cli(argv, str(tmp_path), CAPTURE_MEGATRON_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "p.json").read_text())["predicted_peak_bytes"]
    assert os.path.getsize(out / "p.png") > 0
