"""What `predict` and `plan` print and write about the estimated step (tokens/s/GPU, model
TFLOP/s/GPU, MFU, the hardware profile), and bad hardware input on the command line: a zero,
negative, NaN or infinite value, or an unknown --gpu-type, is one paragraph and exit 2 (the real
command line; plan runs in-process on a synthetic memory model, no profiling)."""

from __future__ import annotations

import json

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model
from test_cli_errors import TINY, cli, one_error

from capture_megatron.cli import plan as plan_cli
from capture_megatron.fit import write_model


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    return str(path)


def _plan(model_file: str, tmp_path, capsys, *extra: str) -> tuple[list[str], dict]:
    out = tmp_path / "plan.json"
    argv = [*SMALL_ARGS, "--memory-model", model_file, "--global-batch-size", "32", "--gpus", "8"]
    argv += ["--context-gib", "0", "--no-progress", "--json", str(out), *extra]
    assert plan_cli.main(argv) == 0
    return capsys.readouterr().out.splitlines(), json.loads(out.read_text())


def test_plan_prints_and_writes_throughput_and_mfu(model_file, tmp_path, capsys):
    """The estimated step with tokens/s/GPU and model TFLOP/s/GPU (MFU), in the table's terms and
    in the JSON (the existing keys kept); the default memory is the --gpu-type's."""
    lines, data = _plan(model_file, tmp_path, capsys, "--gpu-memory-gib", "6")
    line = next(ln for ln in lines if ln.startswith("estimated step: "))
    assert "tokens/s/GPU" in line and "model TFLOP/s/GPU (MFU" in line and "h100-sxm" in line
    seconds = data["estimated_step_seconds"]
    tokens = data["plan"]["global_batch_size"] * SMALL.seq_length
    assert data["estimated_tokens_per_s_per_gpu"] == pytest.approx(tokens / seconds / 8)
    assert 0 < data["estimated_mfu"] < 1
    assert data["estimated_model_tflops_per_gpu"] == pytest.approx(
        data["estimated_mfu"] * data["hardware"]["peak_flops"] / 1e12
    )
    assert data["step_time"]["seconds"] == pytest.approx(seconds)
    _, b200 = _plan(model_file, tmp_path, capsys, "--gpu-type", "b200")
    assert b200["hardware"]["name"] == "b200"
    assert b200["gpu_memory_bytes"] == b200["hardware"]["memory_bytes"]  # 179 GiB by default
    _, slower = _plan(model_file, tmp_path, capsys, "--gpu-memory-gib", "6", "--peak-tflops", "100")
    assert slower["estimated_step_seconds"] > seconds


BAD = [
    (["--mfu", "0"], "--gemm-efficiency 0 must be in (0, 1]"),
    (["--mfu", "-1"], "--gemm-efficiency -1 must be in (0, 1]"),
    (["--gemm-efficiency", "nan"], "--gemm-efficiency nan"),
    (["--peak-tflops", "0"], "--peak-tflops 0"),
    (["--nvlink-gbps", "-5"], "--nvlink-gbps -5"),
    (["--network-gbps", "inf"], "--network-gbps inf"),
    (["--hbm-gbps", "nan"], "--hbm-gbps nan"),
    (["--host-gbps", "0"], "--host-gbps 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0"),
    (["--gpu-memory-gib", "nan"], "--gpu-memory-gib nan"),
    (["--gpu-type", "tpu-v5"], "--gpu-type 'tpu-v5' is unknown"),
]
"""Bad hardware flags and what the error names."""


@pytest.mark.parametrize(("flags", "named"), BAD)
def test_bad_hardware_values_are_one_paragraph(flags, named, tmp_path):
    """predict refuses them before any profiling, naming the value."""
    done = cli(["predict", *TINY, "--gpus", "2", *flags], str(tmp_path))
    assert named in one_error(done, "predict")


@pytest.mark.parametrize(("flags", "named"), [BAD[0], BAD[4], BAD[-1]])
def test_plan_refuses_bad_hardware_values_too(flags, named, tmp_path):
    """plan reads the same flags the same way."""
    done = cli(["plan", *TINY, "--gpus", "2", *flags], str(tmp_path))
    assert named in one_error(done, "plan")
