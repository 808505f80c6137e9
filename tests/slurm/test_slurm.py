"""A real Slurm (slurmctld + slurmd + munge on this machine) runs generated batch
scripts."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from harness import cli

from capture_megatron.train.checkpoint.save_load import latest_iteration
from capture_megatron.train.report import MemoryReport

TINY = [
    "--num-layers",
    "8",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--vocab-size",
    "512",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
]
FIXED = [
    "--device",
    "cpu",
    "--tensor-model-parallel-size",
    "1",
    "--recompute-granularity",
    "none",
    "--num-virtual-stages-per-pipeline-rank",
    "1",
    "--mock-data",
    "--no-progress",
]


TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE")
"""Job states a job does not leave (a requeued job passes through REQUEUED and PENDING)."""


def _submit(cluster, script: str, cwd: str, **env: str) -> str:
    """sbatch the script; its job id."""
    done = subprocess.run(
        ["sbatch", "--parsable", script],
        env=dict(cluster.env, **env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _job(cluster, job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields."""
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return dict(word.split("=", 1) for word in shown.stdout.split() if "=" in word)


def _wait(cluster, job_id: str, timeout: float = 600) -> dict[str, str]:
    """Poll until the job has ended (sbatch --wait polls at up to 32 s intervals); its fields."""
    deadline = time.monotonic() + timeout
    while (job := _job(cluster, job_id)).get("JobState") not in TERMINAL:
        assert time.monotonic() < deadline, f"job {job_id} still {job.get('JobState')}"
        time.sleep(0.5)
    return job


def _sbatch(cluster, script: str, cwd: str) -> int:
    """Run the script as a job to its end; the exit code of its batch shell."""
    job = _wait(cluster, _submit(cluster, script, cwd))
    return int(job["ExitCode"].split(":")[0]) or (job["JobState"] != "COMPLETED")


def test_slurm_sees_four_tasks(slurm_cluster, tmp_path):
    script = tmp_path / "ranks.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=4\n#SBATCH --output=" + str(tmp_path / "out") + "\n"
        "srun bash -c 'echo $SLURM_PROCID $SLURM_LOCALID $SLURM_NTASKS $SLURM_JOB_NODELIST'\n"
    )
    assert _sbatch(slurm_cluster, str(script), str(tmp_path)) == 0
    rows = sorted(
        line.split() for line in (tmp_path / "out").read_text().splitlines() if line.strip()
    )
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and all(r[2] == "4" for r in rows)


def _launch(tmp_path, mode: str, *extra: str) -> None:
    """Render a batch script for 4 CPU ranks (PP 4) of the TINY model at tmp_path/job.sh."""
    done = cli(
        [
            "launch",
            *TINY,
            *FIXED,
            "--nodes",
            "1",
            "--gpus-per-node",
            "4",
            "--cpu",
            "--mode",
            mode,
            "--pipeline-model-parallel-size",
            "4",
            "--python",
            sys.executable,
            "--memory-report",
            str(tmp_path / "mem.json"),
            "--output",
            str(tmp_path / "slurm-%j.out"),
            *extra,
            "--sbatch",
            str(tmp_path / "job.sh"),
        ],
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_generated_script_trains_on_slurm(slurm_cluster, tmp_path):
    """tasks mode: the four ranks are Slurm tasks (torchrun mode runs in the requeue test)."""
    _launch(tmp_path, "tasks", "--train-iters", "2")
    rc = _sbatch(slurm_cluster, str(tmp_path / "job.sh"), str(tmp_path))
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert rc == 0, logs[-3000:]
    rep = MemoryReport.read(str(tmp_path / "mem.json"))
    assert len(rep.ranks) == 4 and len(rep.iterations) == 2
    assert rep.plan.layout.count("|") == 3 and rep.stage_peaks()[0] > 0


def _signal_during_save(cluster, job_id: str, partial) -> None:
    """Once the ranks are inside the save of `partial`, send the batch shell the USR1 that Slurm
    sends --signal-seconds before the time limit."""
    deadline = time.monotonic() + 300
    while not partial.exists():
        state = _job(cluster, job_id).get("JobState")
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, state
        time.sleep(0.2)
    subprocess.run(
        ["scancel", "--batch", "--signal=USR1", job_id], env=cluster.env, check=True, timeout=30
    )


def test_requeued_job_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    """torchrun mode, --requeue: USR1 mid-run -> the ranks save iteration 3 and exit, the job
    requeues itself, and the second start loads that checkpoint and trains iterations 4-6."""
    save = tmp_path / "ckpt"
    _launch(
        tmp_path,
        "torchrun",
        *("--train-iters", "6", "--save", str(save), "--save-interval", "2", "--requeue"),
    )
    # the ranks pause 4 s inside the save of iteration 2 (the test's window to signal)
    job_id = _submit(
        slurm_cluster,
        str(tmp_path / "job.sh"),
        str(tmp_path),
        CAPTURE_MEGATRON_TEST_SAVE_PAUSE="4@2",
    )
    _signal_during_save(slurm_cluster, job_id, save / "iter_0000002.partial")
    job = _wait(slurm_cluster, job_id)
    logs = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", logs[-4000:]
    assert job["Restarts"] == "1"
    assert "SIGUSR1 received: exiting after iteration 3 of 6 (checkpoint saved)" in logs, logs
    assert "checkpoint at iteration 3 of 6: requeueing job" in logs
    assert "start 1 of job" in logs and "resumed from checkpoint iteration 3 in" in logs
    rep = MemoryReport.read(str(tmp_path / "mem.json"))  # written by the second start
    assert [it.iteration for it in rep.iterations] == [4, 5, 6]
    assert latest_iteration(str(save)) == 6


def test_failing_job_exits_nonzero(slurm_cluster, tmp_path):
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\n#SBATCH --output=/dev/null\nexit 3\n")
    assert _sbatch(slurm_cluster, str(script), str(tmp_path)) != 0


BIG = [
    *("--preset", "llama3-8b", "--micro-batch-size", "1", "--global-batch-size", "512"),
    *("--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4"),
    *("--pipeline-model-parallel-layout", "Etttttttt|tttttttt|tttttttt|ttttttttL"),
    *("--device", "fake", "--gpu-memory-gib", "80"),
]
"""Llama-3-8B on 16 x 8 GPUs (TP 8, PP 4, DP 4): the step-time model's 7.5 s per step on an H100
(docs/STEP_TIME.md) x 2000 iterations is about 4.2 h, longer than --time 02:00:00."""
JOB = [
    *("--nodes", "16", "--gpus-per-node", "8", "--account", "proj", "--partition", "gpu"),
    *("--time", "02:00:00", "--data-path", "/data/corpus_text_document", "--train-iters", "2000"),
    *("--save", "/ckpt/llama", "--save-interval", "500", "--requeue"),
    *("--container-image", "nvcr.io/nvidia/pytorch:25.01-py3"),
    *("--container-mounts", "/lustre/data:/data,/lustre/ckpt:/ckpt", "--container-workdir", "/ws"),
]


def test_sixteen_nodes_of_eight_gpus_script(slurm_cluster, tmp_path):
    """The script for 16 nodes x 8 GPUs passes `sbatch --test-only` on the test cluster's sixteen
    DGX-H100-shaped (never started) nodes, and states what an admin expects."""
    script = tmp_path / "big.sh"
    done = cli(["launch", *BIG, *JOB, "--sbatch", str(script)], cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning: the cost model estimates 4 h 9 min for the 2000 iterations" in done.stderr
    text = script.read_text()
    for expected in (
        "# WARNING: the cost model estimates 4 h 9 min",
        "#SBATCH --nodes=16",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
        "#SBATCH --account=proj",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=02:00:00",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "--nnodes 16 --nproc-per-node 8",
        "--rdzv-backend c10d",
        "--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
        "--container-mounts=/lustre/data:/data,/lustre/ckpt:/ckpt,",  # then this package, ro
        ":ro --container-workdir=/ws",
        "--tensor-model-parallel-size 8",
        "--pipeline-model-parallel-size 4",
        "'Etttttttt|tttttttt|tttttttt|ttttttttL'",
        "--data-path /data/corpus_text_document",
        "--exit-signal-handler",
        "--exit-signal SIGUSR1",
        '--load "$CKPT_LOAD"',
    ):
        assert expected in text, expected
    assert re.search(
        r'MASTER_ADDR="\$\(scontrol show hostnames "\$SLURM_JOB_NODELIST" \| head -n 1\)"', text
    )
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    tested = _test_only(slurm_cluster, script)
    assert tested.returncode == 0, tested.stderr
    # --exclusive: all 224 CPUs of each of the 16 nodes
    assert "using 3584 processors on nodes gpu[01-16] in partition gpu" in tested.stderr
    # a real check: one node more, or more CPUs per task than a node has, is refused
    for old, new in (("--nodes=16", "--nodes=17"), ("--cpus-per-task=64", "--cpus-per-task=300")):
        script.write_text(text.replace(old, new))
        refused = _test_only(slurm_cluster, script)
        assert refused.returncode != 0, new
        assert "Requested node configuration is not available" in refused.stderr, new


def _test_only(cluster, script) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sbatch", "--test-only", str(script)],
        env=cluster.env,
        cwd=str(script.parent),
        capture_output=True,
        text=True,
        timeout=60,
    )
