"""`capture-megatron launch --plan-json p.json` (issue 29, item 5): the model and parallel flags
given must be the plan file's (they were ignored without a word: the plan file's model was
written), every training flag given reaches the script (--init-method-std was dropped), and a
container job gets this capture_megatron mounted and checked before it starts. In-process, on a
plan written from a synthetic memory model (no profiling)."""

from __future__ import annotations

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model

from capture_megatron.cli import launch, plan
from capture_megatron.errors import CaptureError
from capture_megatron.fit import write_model
from capture_megatron.train.slurm import CONTAINER_ROOT, PACKAGE_DIR

JOB = ["--nodes", "1", "--gpus-per-node", "8", "--train-iters", "100", "--mock-data"]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("launch")
    model = str(work / "memory_model.json")
    write_model(full_model(SMALL), model)
    out = str(work / "plan.json")
    argv = [*SMALL_ARGS, "--memory-model", model, "--gpus", "8", "--gpu-memory-gib", "80"]
    assert plan.main([*argv, "--global-batch-size", "32", "--no-progress", "--json", out]) == 0
    return out


def test_another_model_or_plan_than_the_files_is_refused(plan_file, tmp_path):
    sbatch = tmp_path / "job.sh"
    other = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32"]
    other += ["--seq-length", "2048", "--vocab-size", "32000"]
    with pytest.raises(CaptureError) as err:
        launch.main([*other, "--plan-json", plan_file, *JOB, "--sbatch", str(sbatch)])
    text = str(err.value)
    assert "--num-layers 32 given, 16 in the plan file" in text
    assert "--hidden-size 4096 given, 2048 in the plan file" in text
    assert "--bf16 / --fp16 (precision) fp32 given, bf16 in the plan file" in text
    with pytest.raises(CaptureError, match="--tensor-model-parallel-size 8 given, "):
        launch.main(
            [*SMALL_ARGS, "--plan-json", plan_file, *JOB, "--sbatch", str(sbatch)]
            + ["--tensor-model-parallel-size", "8"]
        )
    assert not sbatch.exists()


def test_the_files_model_and_every_training_flag_reach_the_script(plan_file, tmp_path):
    training = ["--lr", "0.0003", "--min-lr", "3e-05", "--lr-decay-style", "cosine"]
    training += ["--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "0.5"]
    training += ["--init-method-std", "0.006", "--seed", "42"]
    for model in (SMALL_ARGS, []):  # the plan's own model flags, or none at all
        sbatch = tmp_path / "job.sh"
        argv = [*model, "--plan-json", plan_file, *JOB, *training, "--sbatch", str(sbatch)]
        assert launch.main(argv) == 0
        words = sbatch.read_text().split()
        for flag, value in zip(training[::2], training[1::2], strict=True):
            assert words[words.index(flag) + 1] == value, flag
        assert words[words.index("--hidden-size") + 1] == str(SMALL.hidden_size)


def test_a_container_job_mounts_and_checks_capture_megatron(plan_file, tmp_path):
    sbatch = tmp_path / "job.sh"
    image = ["--container-image", "nvcr.io/nvidia/pytorch:25.01-py3"]
    argv = ["--plan-json", plan_file, *JOB, *image, "--sbatch", str(sbatch)]
    assert launch.main(argv) == 0
    text = sbatch.read_text()
    mount = f"{PACKAGE_DIR}:{CONTAINER_ROOT}/capture_megatron:ro"
    assert text.count(mount) == 2  # the import check's step and the training step
    assert f"export PYTHONPATH={CONTAINER_ROOT}" in text
    assert "-c 'import capture_megatron, megatron.core, torch' || {" in text
    assert text.index("import capture_megatron") < text.index("-m capture_megatron.pretrain_gpt")
