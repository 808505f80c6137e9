"""The --save directory is the user's (issue 56, problems 2 and 3): a second run into a directory
another live run is saving into is refused -- by `capture-megatron train` before torchrun starts
and by the ranks of a run started without it -- and changes nothing there; once that run is gone
its stale lock and incomplete save are taken over and the next run resumes; a --load whose tracker
is gone resumes from the newest complete checkpoint instead of training from scratch over it, and
a --load that finds nothing says so (Megatron-LM's `--load D --save D` first run of a requeued job).

Single-process runs (pretrain_gpt's launcher-less gloo group of one) keep these fast; the launcher's
refusal starts no torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import cli, train_single

from capture_megatron.train.checkpoint.save_load import PAUSE_ENV, TRACKER, iteration_dir

TINY = [
    *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"),
    *("--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "257"),
    *("--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data"),
    *("--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--seed", "7"),
    "--no-progress",
]
FOUR = [*TINY, "--train-iters", "4", "--save-interval", "2"]
MANIFEST = "capture_megatron_checksums.json"


def _manifests(root: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in sorted(root.glob(f"iter_*/{MANIFEST}"))}


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> tuple[Path, str]:
    """Four iterations, checkpoints at 2 and 4, saved by the first run of a requeued job:
    --load D --save D with D not there yet; (D, what the run printed)."""
    work = tmp_path_factory.mktemp("save-dir")
    ckpt = work / "ckpt"
    run = train_single([*FOUR, "--load", str(ckpt), "--save", str(ckpt)], str(work), "first")
    assert run.returncode == 0, run.output[-3000:]
    assert (ckpt / TRACKER).read_text().strip() == "4"
    return ckpt, run.output


def test_a_load_that_finds_nothing_says_so(first):
    ckpt, output = first
    assert f"--load {ckpt}: no checkpoint there: starting from iteration 0" in output


def test_a_load_without_its_tracker_resumes_from_the_newest_checkpoint(first, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first[0], ckpt)
    (ckpt / TRACKER).unlink()
    before = _manifests(ckpt)
    args = [*TINY, "--train-iters", "4", "--load", str(ckpt), "--save", str(ckpt)]
    run = train_single(args, str(tmp_path), "resumed")
    assert run.returncode == 0 and run.report is not None, run.output[-3000:]
    assert f"has no {TRACKER} but holds complete checkpoints (iterations 2, 4)" in run.output
    assert run.report.iterations == () and "resumed from checkpoint iteration 4" in run.output
    assert _manifests(ckpt) == before  # not one file rewritten


def _start_saving(args: list[str], workdir: Path) -> subprocess.Popen:
    """A run that saves iteration 2, then stays in the middle of its iteration 4 save."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **{PAUSE_ENV: "90@4"})
    return subprocess.Popen(
        [sys.executable, "-m", "capture_megatron.pretrain_gpt", *args],
        env=env,
        cwd=str(workdir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_a_second_run_into_a_directory_in_use_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _start_saving([*FOUR, "--save", str(ckpt)], tmp_path)
    partial = Path(iteration_dir(str(ckpt), 4) + ".partial")
    try:
        deadline = time.time() + 240
        while not (partial.is_dir() and any(partial.iterdir())) and time.time() < deadline:
            assert first.poll() is None, "the first run ended before its second save"
            time.sleep(0.2)
        time.sleep(1)
        state = _manifests(ckpt), sorted(p.name for p in partial.iterdir())
        other = [*TINY, "--train-iters", "2", "--lr", "5e-3", "--seed", "8", "--save", str(ckpt)]
        by_launcher = cli(["train", "--nproc", "1", *other])
        by_rank = train_single(other, str(tmp_path), "second")
        outcomes = [(by_launcher.returncode, by_launcher.stderr)]
        outcomes.append((by_rank.returncode, by_rank.output))
        for rc, out in outcomes:
            assert rc == 2 and "Traceback" not in out, out[-3000:]
            assert f"--save {ckpt} is in use by another training run: PID {first.pid} on " in out
        assert (_manifests(ckpt), sorted(p.name for p in partial.iterdir())) == state
        assert (ckpt / TRACKER).read_text().strip() == "2"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the first run is gone: the next takes its lock over, drops its incomplete save, resumes
    resumed = train_single([*FOUR, "--load", str(ckpt), "--save", str(ckpt)], str(tmp_path), "r")
    assert resumed.returncode == 0 and resumed.report is not None, resumed.output[-3000:]
    assert f"took over the lock of a run that is gone (PID {first.pid} on " in resumed.output
    assert "removed the incomplete save iter_0000004.partial" in resumed.output
    assert [it.iteration for it in resumed.report.iterations] == [3, 4]
    assert (ckpt / TRACKER).read_text().strip() == "4"
    assert json.loads((ckpt / "capture_megatron.lock").read_text() or "null") is None
