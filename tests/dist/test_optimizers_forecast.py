"""SGD's forecast against a trained run (issue 51): `capture-megatron verify` plans the flags with
--optimizer sgd, trains them under real torchrun + gloo with megatron-core's SGD (torch's, wrapped
in Float16OptimizerWithFloat16Params: fp32 master weights, one fp32 momentum buffer each, and
torch's single-tensor step holding `grad.add(param, alpha=wd)`), and every rank's measured peak is
within 2% of its forecast. The model is wide and short so that the static bytes and the step, what
the optimizer changes, make the peak."""

from __future__ import annotations

import json

from harness import cli
from test_precision_forecast import WIDE


def test_sgd_state_and_step_are_forecast_within_2_percent(tmp_path):
    out = tmp_path / "verify.json"
    flags = [f for f in WIDE if f != "--use-distributed-optimizer"]  # SGD: megatron-core asserts
    run = ["--nproc", "2", "--device", "cpu", "--mock-data", "--train-iters", "2", "--bf16"]
    done = cli(
        ["verify", *flags, "--global-batch-size", "4", "--optimizer", "sgd", *run,
         "--no-progress", "--json", str(out)],
        timeout=600,
        cwd=str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["plan"]["ddp"]["optimizer"]["optimizer"] == "sgd" and "step" in done.stdout
    print(f"SGD, DP 2: max prediction error {100 * result['max_abs_error']:.2f}%")
    assert result["max_abs_error"] <= 0.02
