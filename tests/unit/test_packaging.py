"""The built wheel holds every module and data file, and a non-editable install of it works: a fresh
virtualenv runs `capture-megatron --help`, a fake-mode `plan`, and a Slurm `launch` from its plan.

The fresh virtualenv sees the already installed dependencies (torch, megatron-core, ...) through a
.pth file, so nothing is downloaded; pip still checks the wheel's requirements against them."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import capture_megatron

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(capture_megatron.__file__).parent.parent
PACKAGE_DATA = (
    "py.typed",
    "flags/megatron_args.json",
    "steptime/constants.json",
    "forecast/moe_routing.json",
    "flags/megatron_args-0.19.json",
    "train/templates/sbatch_torchrun.sh",
    "train/templates/sbatch_tasks.sh",
)
MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256 "
    "--micro-batch-size 1 --global-batch-size 4 --tensor-model-parallel-size 1 "
    "--pipeline-model-parallel-size 2 --recompute-granularity none "
    "--num-virtual-stages-per-pipeline-rank 1"
).split()


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, " ".join(cmd) + "\n" + done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ]
    )
    (path,) = out.glob("capture_megatron-*.whl")
    return path


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "capture_megatron"
    sources = {f"capture_megatron/{p.relative_to(package)}" for p in package.rglob("*.py")}
    data = {f"capture_megatron/{name}" for name in PACKAGE_DATA}
    assert sources - names == set() and data - names == set()
    assert not any(n.startswith(("examples/", "tests/")) for n in names)  # repository-only
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert f"Version: {capture_megatron.__version__}" in text
    assert "Requires-Dist: megatron-core" in text


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> pathlib.Path:
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(root)])
    python = root / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    site = pathlib.Path(purelib.stdout.strip())
    (site / "installed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the venv's bundled setuptools would shadow the installed one (torch requires a newer one)
    run([str(python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"])
    run([str(python), "-m", "pip", "install", "-q", "--no-index", str(wheel)])
    return root


def test_installed_wheel_runs_help_plan_and_launch(venv, tmp_path):
    env = dict(os.environ, CAPTURE_MEGATRON_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    where = run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import capture_megatron; print(capture_megatron.__file__)",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    cli = str(venv / "bin" / "capture-megatron")
    assert "plan" in run([cli, "--help"], cwd=tmp_path, env=env).stdout
    plan_json = tmp_path / "plan.json"
    run(
        [
            cli,
            "plan",
            *MODEL,
            "--device",
            "fake",
            "--gpus",
            "2",
            "--gpu-memory-gib",
            "8",
            "--json",
            str(plan_json),
            "--png",
            str(tmp_path / "plan.png"),
            "--no-progress",
        ],
        cwd=tmp_path,
        env=env,
    )
    plan = json.loads(plan_json.read_text())
    assert plan["plan"]["pp"] == 2 and plan["memory_model"]["device"] == "fake-cuda"
    assert (tmp_path / "plan.png").stat().st_size > 0
    job = tmp_path / "job.sh"
    run(
        [
            cli,
            "launch",
            *MODEL,
            "--mock-data",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--plan-json",
            str(plan_json),
            "--sbatch",
            str(job),
        ],
        cwd=tmp_path,
        env=env,
    )
    assert plan["plan"]["layout"] in job.read_text()
    run(
        [str(venv / "bin" / "python"), "-c", "import capture_megatron.megatron_lm.pretrain_gpt"],
        cwd=tmp_path,
        env=env,
    )
