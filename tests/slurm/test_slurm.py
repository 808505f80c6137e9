"""A real Slurm (slurmctld + slurmd + munge on this machine) runs generated batch
scripts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from harness import cli

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
    "--train-iters",
    "2",
    "--no-progress",
]


def _sbatch(cluster, script: str, cwd: str) -> int:
    return subprocess.run(
        ["sbatch", "--wait", script],
        env=cluster.env,
        cwd=cwd,
        timeout=600,
        capture_output=True,
        text=True,
    ).returncode


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


@pytest.mark.parametrize("mode", ["torchrun", "tasks"])
def test_generated_script_trains_on_slurm(slurm_cluster, tmp_path, mode):
    report, script = tmp_path / "mem.json", tmp_path / "job.sh"
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
            str(report),
            "--output",
            str(tmp_path / "slurm-%j.out"),
            "--sbatch",
            str(script),
        ],
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rc = _sbatch(slurm_cluster, str(script), str(tmp_path))
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert rc == 0, logs[-3000:]
    rep = MemoryReport.read(str(report))
    assert len(rep.ranks) == 4 and len(rep.iterations) == 2
    assert rep.plan.layout.count("|") == 3 and rep.stage_peaks()[0] > 0


def test_failing_job_exits_nonzero(slurm_cluster, tmp_path):
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\n#SBATCH --output=/dev/null\nexit 3\n")
    assert _sbatch(slurm_cluster, str(script), str(tmp_path)) != 0


def test_sixteen_nodes_of_eight_gpus_script(tmp_path):
    script = tmp_path / "big.sh"
    model = [
        "--num-layers",
        "32",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "128",
        "--vocab-size",
        "1024",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "64",
    ]
    plan = [
        "--tensor-model-parallel-size",
        "8",
        "--pipeline-model-parallel-size",
        "4",
        "--pipeline-model-parallel-layout",
        "Ettttttt|tttttttt|tttttttt|tttttttttL",
        "--device",
        "fake",
        "--gpu-memory-gib",
        "80",
    ]
    done = cli(
        [
            "launch",
            *model,
            *plan,
            "--nodes",
            "16",
            "--gpus-per-node",
            "8",
            "--account",
            "proj",
            "--partition",
            "gpu",
            "--time",
            "02:00:00",
            "--data-path",
            "/data/corpus_text_document",
            "--container-image",
            "nvcr.io/nvidia/pytorch:25.01-py3",
            "--sbatch",
            str(script),
        ],
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = script.read_text()
    for expected in (
        "#SBATCH --nodes=16",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --account=proj",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=02:00:00",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "--nnodes 16 --nproc-per-node 8",
        "--rdzv-backend c10d",
        "--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
        "--tensor-model-parallel-size 8",
        "--pipeline-model-parallel-size 4",
        "'Ettttttt|tttttttt|tttttttt|tttttttttL'",
        "--data-path /data/corpus_text_document",
    ):
        assert expected in text, expected
    assert re.search(
        r'MASTER_ADDR="\$\(scontrol show hostnames "\$SLURM_JOB_NODELIST" \| head -n 1\)"', text
    )
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
