"""Nothing saved is lost or trusted blindly (issue 29, items 1, 4, 9, 10).

- A save never replaces an ``iter_N/`` it did not write (issue 56): a rollback into the directory
  that holds later checkpoints is refused (saved elsewhere, it keeps its new learning rate), and
  after a kill between the rename and the tracker write the rerun takes that complete checkpoint.
- Every file is checksummed; flipped bytes or a truncated shard, ``.metadata`` or ``common.pt`` in
  the newest checkpoint make the resume fall back to the previous complete one, in one paragraph.
- A full disk during a save is "no space left on the device", and names the checkpoint that
  survived.
- The --save directory is the user's (issue 56, problems 2 and 3): a second run into a directory
  another live run is saving into is refused by its ranks and changes nothing there, and once that
  run is gone its lock is stale; a --load whose tracker is gone resumes from the newest complete
  checkpoint instead of training from scratch over it, and a --load that finds nothing says so
  (Megatron-LM's `--load D --save D` first run of a requeued job, which the module's first run is).

Single-process runs (pretrain_gpt's launcher-less gloo group of one) keep these fast.
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
import torch
from harness import cli, train_single

from capture_megatron.cli.train import main as train_cli
from capture_megatron.errors import CaptureError
from capture_megatron.train.checkpoint import verify as ckpt_verify
from capture_megatron.train.checkpoint.save_load import PAUSE_ENV, TRACKER, iteration_dir
from capture_megatron.train.checkpoint.verify import MANIFEST, quick_problems

TINY = [
    *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"),
    *("--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "257"),
    *("--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data"),
    *("--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--seed", "7"),
    "--no-progress",
]
FOUR = [*TINY, "--train-iters", "4", "--save-interval", "2"]


def _manifest(ckpt: Path, it: int) -> dict:
    return json.loads(Path(iteration_dir(str(ckpt), it), MANIFEST).read_text())["files"]


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> tuple[Path, str]:
    """Four iterations, checkpoints at 2 and 4 (tracker: 4), saved by the first run of a
    requeued job: --load D --save D with D not there yet; (D, what the run printed)."""
    work = tmp_path_factory.mktemp("integrity")
    ckpt = work / "ckpt"
    run = train_single([*FOUR, "--load", str(ckpt), "--save", str(ckpt)], str(work), "first")
    assert run.returncode == 0, run.output[-3000:]
    assert (ckpt / TRACKER).read_text().strip() == "4"
    return ckpt, run.output


@pytest.fixture(scope="module")
def saved(first) -> Path:
    """The first run's checkpoints (copy them before changing anything)."""
    return first[0]


def test_a_rollback_never_replaces_later_checkpoints(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    old = _manifest(ckpt, 4)
    (ckpt / TRACKER).write_text("2")  # roll back to iteration 2
    args = [*FOUR, "--lr", "1e-2", "--override-opt_param-scheduler", "--load", str(ckpt)]
    with pytest.raises(CaptureError, match=r"already holds complete checkpoints after it \(iter"):
        train_cli(["--nproc", "1", *args, "--save", str(ckpt)])  # before torchrun starts
    assert _manifest(ckpt, 4) == old and (ckpt / TRACKER).read_text() == "2"
    # the rollback saved elsewhere: its checkpoints are its own
    other = tmp_path / "rolled-back"
    run = train_single([*args, "--save", str(other)], str(tmp_path), "b")
    assert run.returncode == 0, run.output[-3000:]
    assert [it.iteration for it in run.report.iterations] == [3, 4]
    # the new peak on the old schedule's shape (linear decay over 4 iterations, 2 done); loading
    # the optimizer's param groups used to bring the checkpoint's 1e-3 back without a word
    assert [it.lr for it in run.report.iterations] == pytest.approx([5e-3, 2.5e-3])
    assert (other / TRACKER).read_text().strip() == "4"
    new = _manifest(other, 4)
    shards = [n for n in old if n.endswith(".distcp")]
    assert shards and any(new[n]["sha256"] != old[n]["sha256"] for n in shards)
    common = torch.load(Path(iteration_dir(str(other), 4), "common.pt"), weights_only=True)
    assert common["opt_param_scheduler"]["max_lr"] == pytest.approx(1e-2)
    assert quick_problems(iteration_dir(str(other), 4)) == [] and _manifest(ckpt, 4) == old


def test_kill_between_rename_and_tracker_then_rerun(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*FOUR, "--save", str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{PAUSE_ENV: "120@4:published"})
    log = tmp_path / "first.log"  # what the run printed, should it end before it is killed
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "capture_megatron.pretrain_gpt", *args],
            env=env,
            cwd=str(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.time() + 240
    published = Path(iteration_dir(str(ckpt), 4))
    while not published.is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, f"exit {proc.returncode}: {log.read_text()[-4000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert published.is_dir() and (ckpt / TRACKER).read_text().strip() == "2"
    written = _manifest(ckpt, 4)
    # the rerun takes the complete iteration 4 (the publish is finished), never saves over it
    run = train_single([*args, "--load", str(ckpt)], str(tmp_path), "rerun")
    assert run.returncode == 0 and run.report is not None, run.output[-3000:]
    assert run.report.iterations == () and "finished publishing iteration 4" in run.output
    assert "resumed from checkpoint iteration 4" in run.output
    assert "nothing to train: iteration 4 is already saved" in run.output
    assert (ckpt / TRACKER).read_text().strip() == "4" and _manifest(ckpt, 4) == written
    assert not list(ckpt.glob("*.replaced")) and not list(ckpt.glob("*.partial"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, name, words",
    [
        (_flip, "__0_0.distcp", "__0_0.distcp does not match its SHA-256"),
        (_truncate, "__0_1.distcp", "__0_1.distcp has"),
        (_truncate, ".metadata", ".metadata has"),
        (_truncate, "common.pt", "common.pt has"),
    ],
)
def test_damaged_newest_checkpoint_falls_back(saved, tmp_path, damage, name, words):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    damage(Path(iteration_dir(str(ckpt), 4), name))
    run = train_single([*TINY, "--train-iters", "4", "--load", str(ckpt)], str(tmp_path), "r")
    assert run.returncode == 0, run.output[-3000:]
    assert [it.iteration for it in run.report.iterations] == [3, 4]
    assert "Traceback" not in run.output
    assert words in run.output and "Resuming from iteration 2" in run.output, run.output[-3000:]


def test_every_checkpoint_damaged_is_one_paragraph(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    for it in (2, 4):
        _truncate(Path(iteration_dir(str(ckpt), it), "common.pt"))
    refused = cli(["train", "--nproc", "1", *TINY, "--train-iters", "4", "--load", str(ckpt)])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "no complete checkpoint there can be trusted" in refused.stderr
    assert "iteration 4: common.pt has" in refused.stderr


def _can_mount() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs root to mount a small tmpfs")
def test_disk_full_during_save(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    ckpt = mount / "ckpt"
    args = [*FOUR, "--save", str(ckpt), "--memory-report", str(tmp_path / "r.json")]
    inner = " ".join([sys.executable, "-m", "capture_megatron.pretrain_gpt", *args])
    # one checkpoint is ~250 KiB: room for the first, not the second
    script = f"mount -t tmpfs -o size=400k tmpfs {mount} && {inner}; rc=$?; "
    script += f"cat {ckpt}/{TRACKER}; ls {ckpt}; exit $rc"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "saving checkpoint iteration 4" in out and "no space left on the device" in out
    assert "The last complete checkpoint, iteration 2" in out, out[-3000:]
    assert "iter_0000004.partial" not in done.stdout.split("was removed")[-1]


class _RunsCode:
    """Unpickling this runs a shell command (what a crafted checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("target", [".metadata", "common.pt"])
def test_a_checkpoint_that_would_run_code_is_refused(saved, tmp_path, target):
    import pickle

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    marker = tmp_path / "pwned"
    d = Path(iteration_dir(str(ckpt), 4))
    if target == ".metadata":
        (d / target).write_bytes(pickle.dumps(_RunsCode(str(marker))))
    else:
        torch.save({"iteration": 4, "evil": _RunsCode(str(marker))}, d / target)
    # the attacker rewrites the checksums too: they guard against damage, not against intent
    names = ckpt_verify.files_to_hash(str(d))
    ckpt_verify.write_manifest(str(d), ckpt_verify.digests(str(d), names))
    args = [*TINY, "--train-iters", "4", "--load", str(ckpt)]
    refused = cli(["train", "--nproc", "1", *args])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "could run code" in refused.stderr and target in refused.stderr
    ranks = train_single(args, str(tmp_path), "direct")  # the ranks check on their own too
    assert ranks.returncode == 2 and "could run code" in ranks.output, ranks.output[-3000:]
    assert not marker.exists()


def _manifests(root: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in sorted(root.glob(f"iter_*/{MANIFEST}"))}


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
        # the ranks' own check (a job started without `capture-megatron train`, whose check
        # before torchrun is tests/unit/test_save_lock.py's)
        second = train_single(other, str(tmp_path), "second")
        assert second.returncode == 2 and "Traceback" not in second.output, second.output[-3000:]
        assert f"--save {ckpt} is in use by another training run: PID {first.pid} on " in (
            second.output
        )
        assert (_manifests(ckpt), sorted(p.name for p in partial.iterdir())) == state
        assert (ckpt / TRACKER).read_text().strip() == "2"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the first run is gone: its lock is stale (the next run takes it over, removes the
    # incomplete save and resumes: tests/dist/test_checkpoint.py's kill during a save)
    from capture_megatron.train.checkpoint.lock import check_free

    check_free(str(ckpt))
    assert (ckpt / TRACKER).read_text().strip() == "2" and _manifests(ckpt) == state[0]
