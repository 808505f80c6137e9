"""examples/ (issue 30): every script a user starts from runs to the end with the installed
`capture-megatron` command and prints what it promises. The two that train (torchrun, gloo) are
`dist`; the two that profile a GPU model on the fake CUDA device are `slow`, and so is the Python
API example (issue 54); the checks of the scripts themselves (listed in examples/README.md,
strict bash, the pasted Megatron-LM line verbatim) are fast."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
PASTED = ROOT / "tests" / "data" / "megatron_lm_examples" / "docs_training_examples_gpt3.args"
"""The Megatron-LM launch line predict_pasted_line.sh pastes (NVIDIA/Megatron-LM@core_v0.16.1
docs/user-guide/training-examples.md, "GPT-3 Training Example")."""


def run_example(name: str, workdir: Path, timeout: float, *extra: str) -> str:
    """Run examples/`name` in `workdir` (then `extra` arguments) with this interpreter's
    `capture-megatron` and `python3` first on PATH; assert exit 0 and return stdout and stderr
    together."""
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        ["bash", str(EXAMPLES / name), str(workdir), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    return output


def test_every_script_is_listed_strict_and_parses():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.sh"))
    assert len(scripts) == 4, scripts
    readme = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        text = (EXAMPLES / name).read_text()
        assert f"`{name}`" in readme, name
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text, name
        assert "capture-megatron " in text, name
        syntax = subprocess.run(["bash", "-n", str(EXAMPLES / name)], capture_output=True)
        assert syntax.returncode == 0, (name, syntax.stderr)


def test_the_pasted_line_is_megatron_lms_verbatim():
    script = (EXAMPLES / "predict_pasted_line.sh").read_text()
    call = script[script.index("capture-megatron predict \\\n") :].split("\n\n")[0]
    words = shlex.split(call.replace("\\\n", " "))
    lines = PASTED.read_text().splitlines()
    pasted = [w for ln in lines if ln and not ln.startswith("#") for w in shlex.split(ln)]
    assert words[2 : 2 + len(pasted)] == pasted
    assert words[2 + len(pasted) :][:2] == ["--gpus", "8"]  # the line's torchrun GPUs


RANK_ERROR = re.compile(r"pipeline rank \d+: predicted .* \(([-+\d.]+)%\)")
"""A rank's line of plan_and_train_small_gpt_cpu.sh: its relative error."""


@pytest.mark.dist
def test_plan_and_train_small_gpt_cpu(tmp_path):
    output = run_example("plan_and_train_small_gpt_cpu.sh", tmp_path, timeout=900)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert f"trained the planned layout {plan['plan']['layout']}" in output
    errors = [float(e) for e in RANK_ERROR.findall(output)]
    assert len(errors) == plan["plan"]["pp"] == 2, output[-3000:]
    assert all(abs(e) <= 2.0 for e in errors), errors  # the CPU kernel set's validated bound


@pytest.mark.dist
def test_verify_forecast(tmp_path):
    output = run_example("verify_forecast.sh", tmp_path, timeout=900)
    verify = json.loads((tmp_path / "verify.json").read_text())
    assert len(verify["ranks"]) == verify["plan"]["pp"] == 2
    assert verify["max_abs_error"] <= verify["tolerance"] == 0.02
    assert f"max |error| {100 * verify['max_abs_error']:.2f}% on cpu" in output


@pytest.mark.slow
def test_plan_llama3_70b_slurm(tmp_path):
    # CP and micro-batch fixed: the whole search profiles every TP x CP x micro-batch of the 8192
    # sequence on the fake CUDA device, over 20 minutes cold on 2 busy cores; TP, PP, DP, VPP,
    # recompute and the layout are still searched
    fixed = ("--context-parallel-size", "1", "--micro-batch-size", "1")
    output = run_example("plan_llama3_70b_slurm.sh", tmp_path, 1800, *fixed)
    plan = json.loads((tmp_path / "plan.json").read_text())
    script = (tmp_path / "llama3_70b.sbatch").read_text()
    assert script in output  # printed as written
    assert "#SBATCH --nodes=8" in script and plan["fits"]
    words = script.split()
    layout = words[words.index("--pipeline-model-parallel-layout") + 1]
    assert layout == shlex.quote(plan["plan"]["layout"])  # quoted: '|' is the shell's pipe
    tp = words[words.index("--tensor-model-parallel-size") + 1]
    assert int(tp) == plan["plan"]["tp"]
    assert words[words.index("--num-layers") + 1] == "80"
    assert plan["plan"]["cp"] == 1 and plan["plan"]["micro_batch_size"] == 1


@pytest.mark.slow
@pytest.mark.xdist_group("forecasts")
def test_predict_pasted_line(tmp_path, forecast_cache, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", forecast_cache)  # the API example's line too
    output = run_example("predict_pasted_line.sh", tmp_path, timeout=1800)
    prediction = json.loads((tmp_path / "prediction.json").read_text())
    section = prediction["plan"]
    assert (section["tp"], section["pp"], section["dp"]) == (2, 2, 2)  # the line's, on 8 GPUs
    assert (section["micro_batch_size"], section["global_batch_size"]) == (2, 16)
    assert len(prediction["predicted_peak_bytes"]) == 2
    assert section["layers_per_stage"] == [12, 12]  # Megatron's own split of the line's 24
    assert "the run the flags describe is predicted as given" in output
    assert "prediction.json: TP 2 PP 2 DP 2" in output


@pytest.mark.slow
@pytest.mark.xdist_group("forecasts")
def test_python_api(tmp_path, forecast_cache, monkeypatch, capsys):
    """examples/python_api.py, run in this process as a user's script would (issue 54): predict
    and plan through capture_megatron.predict / plan, from flags and from typed objects; what
    it prints is what the command line prints for the same line."""
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", forecast_cache)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import python_api

    python_api.main(str(tmp_path))
    out = capsys.readouterr().out
    assert "pipeline rank 0: peak" in out and "pipeline rank 1: peak" in out
    plan = json.loads((tmp_path / "llama2-7b-plan.json").read_text())
    assert plan["fits"] and f"layout {plan['plan']['layout']}" in out
    assert "run it with: " + " ".join(plan["megatron_args"]) in out
    assert re.search(r"layout E\S*\|\S*\|\S*\|\S*L: peaks", out), out
    from capture_megatron.cli import main

    assert main(["predict", *python_api.GPT3_EXAMPLE, "--gpus", "8", "--no-progress"]) == 0
    cli = capsys.readouterr().out
    rows = cli[cli.index("chosen plan, per pipeline rank") :].splitlines()[2:4]
    shown = [ln.split("peak ")[1] for ln in out.splitlines() if "pipeline rank" in ln]
    assert shown == [f"{float(row.split()[-2]):.2f} GiB" for row in rows], (shown, rows)
