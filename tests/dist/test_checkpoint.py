"""Checkpoints: resume, reshard, and a save killed half-way.

Real torchrun + gloo + megatron.core.dist_checkpointing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch
from harness import TINY, losses, train

from capture_megatron.train.checkpoint.save_load import PAUSE_ENV, TRACKER, iteration_dir
from capture_megatron.train.launch import torchrun_command

SIX = ["--train-iters", "6", "--lr-decay-iters", "6"]
JOB_ENV = "CAPTURE_MEGATRON_TEST_JOB"
"""An environment variable that marks every process of one test's job (inherited by what it
starts)."""


def _flags(data_prefix: str, *extra: str) -> list[str]:
    return [*TINY, "--data-path", data_prefix, *extra]


def _weights(path: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist checkpoint, in its global (unsharded) shape."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(path)
    meta = reader.read_metadata()
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if not k.startswith(("optimizer", "rng")) and hasattr(m, "size") and "_extra_state" not in k
    }
    with warnings.catch_warnings():  # no_dist=True still warns that it loads in one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


# the distributed optimizer's sharded state; the plain optimizer's checkpoints are resumed by
# test_reshard_pp2_to_pp4_and_tp2 and tests/dist/test_faults.py
@pytest.mark.parametrize("distopt", [True])
def test_resume_equals_straight_run(data_prefix, tmp_path, distopt):
    extra = [
        "--pipeline-model-parallel-size",
        "2",
        "--pipeline-model-parallel-layout",
        "Ettt|tttttL",
    ]
    extra += ["--use-distributed-optimizer"] if distopt else []
    work, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    straight = losses(train(2, _flags(data_prefix, *SIX, *extra), work, "straight"))
    saving = ["--save", ckpt, "--save-interval", "2", "--exit-interval", "4"]
    first = train(2, _flags(data_prefix, *SIX, *extra, *saving), work, "first")
    assert losses(first) == straight[:4]
    assert Path(ckpt, TRACKER).read_text().strip() == "4"
    # --ckpt-step: the older checkpoint, not the tracker's (the newest is what the other resume
    # tests start from: test_reshard_pp2_to_pp4_and_tp2, test_faults.py)
    step = ["--load", ckpt, "--ckpt-step", "2"]
    second = train(2, _flags(data_prefix, *SIX, *extra, *step), work, "second")
    assert losses(second) == pytest.approx(straight[2:], rel=1e-6)
    assert Path(ckpt, TRACKER).read_text().strip() == "4"  # iteration 4 is still there


def test_reshard_pp2_to_pp4_and_tp2(data_prefix, tmp_path):
    work, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    pp2 = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tttttL"]
    straight = losses(train(2, _flags(data_prefix, *SIX, *pp2), work, "straight"))
    assert losses(
        train(2, _flags(data_prefix, *SIX, *pp2, "--save", ckpt, "--exit-interval", "3"), work, "a")
    )
    for name, nproc, extra in (
        (
            "pp4",
            4,
            [
                "--pipeline-model-parallel-size",
                "4",
                "--pipeline-model-parallel-layout",
                "Et|tt|tt|tttL",
            ],
        ),
        ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
    ):
        resaved = str(tmp_path / f"resaved-{name}")
        # train-iters 3: load iteration 3 under the new plan and save it again, unchanged
        run = train(
            nproc,
            _flags(
                data_prefix,
                "--train-iters",
                "3",
                "--lr-decay-iters",
                "6",
                *extra,
                "--load",
                ckpt,
                "--save",
                resaved,
            ),
            work,
            name,
        )
        assert run.returncode == 0, run.output[-3000:]
        saved, loaded = _weights(iteration_dir(ckpt, 3)), _weights(iteration_dir(resaved, 3))
        assert saved.keys() == loaded.keys() and len(saved) > 10
        for key in saved:
            assert torch.equal(saved[key], loaded[key]), key
        cont = train(nproc, _flags(data_prefix, *SIX, *extra, "--load", ckpt), work, name + "-cont")
        assert losses(cont) == pytest.approx(straight[3:], rel=1e-4)


def _left_behind(marker: str, wait: float = 15.0) -> list[str]:
    """The command lines of processes still alive whose environment carries `marker` (a killed
    job's ranks and what they started: megatron-core's checkpoint writers, forked, and the
    multiprocessing Manager it spawns for their results), once they had `wait` seconds to go."""
    deadline = time.time() + wait
    while True:
        alive = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if proc.environ().get(JOB_ENV) == marker and proc.status() != "zombie":
                    alive.append(" ".join(proc.info["cmdline"] or [])[:120])
            except psutil.Error:
                continue
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def test_kill_during_save_keeps_last_checkpoint(data_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = _flags(
        data_prefix,
        *SIX,
        "--pipeline-model-parallel-size",
        "2",
        "--save",
        ckpt,
        "--save-interval",
        "2",
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", **{PAUSE_ENV: "60@2", JOB_ENV: str(tmp_path)})
    proc = subprocess.Popen(
        torchrun_command(2, args),
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    partial = iteration_dir(ckpt, 2) + ".partial"
    deadline = time.time() + 180
    while not (os.path.isdir(partial) and os.listdir(partial)) and time.time() < deadline:
        time.sleep(0.5)
    assert os.path.isdir(partial), "the first save never started"
    time.sleep(2)  # shards are being written / the save is paused before publishing
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not os.path.exists(os.path.join(ckpt, TRACKER)) and not os.path.isdir(
        iteration_dir(ckpt, 2)
    )
    # nothing the job started outlives it (torchrun's ranks die with it, what they started too)
    assert not _left_behind(str(tmp_path))
    # a second run saves iteration 2 completely, then is killed while saving iteration 4
    env[PAUSE_ENV] = "60@4"
    proc = subprocess.Popen(
        torchrun_command(2, args),
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while not os.path.isdir(iteration_dir(ckpt, 4) + ".partial") and time.time() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not _left_behind(str(tmp_path))
    assert Path(ckpt, TRACKER).read_text().strip() == "2"
    resumed = train(
        2,
        _flags(data_prefix, *SIX, "--pipeline-model-parallel-size", "2", "--load", ckpt),
        str(tmp_path),
        "resumed",
    )
    assert [it.iteration for it in resumed.report.iterations] == [3, 4, 5, 6]
