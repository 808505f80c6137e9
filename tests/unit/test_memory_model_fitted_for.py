"""`--memory-model M` is used only for the model it was fitted for, by the capture-megatron that
fitted it (issue 29, item 2): a model fitted at hidden 2048 predicted the same peak for hidden 4096
and 1,000,000 and said "fits"; one fitted on another model was 79% low; one stamped with another
version was used without a word. Each is refused now in one paragraph naming what the file was
fitted for and its probes' ranges. In-process on a synthetic memory model (no profiling)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.cli import predict as predict_cli
from capture_megatron.errors import CaptureError
from capture_megatron.fit import write_model
from capture_megatron.fit.io import check_fitted

PLAN = ["--gpus", "8", "--gpu-memory-gib", "80", "--global-batch-size", "32", "--no-progress"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    return str(path)


def _with(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--hidden-size", "4096"),
        ("--hidden-size", "100000"),  # 1,000,000 is refused as too large to plan
        ("--num-attention-heads", "32"),
        ("--seq-length", "4096"),
        ("--vocab-size", "50257"),
    ],
)
@pytest.mark.parametrize("command", [plan_cli, predict_cli])
def test_another_model_is_refused(model_file, tmp_path, command, flag, value):
    args = _with(SMALL_ARGS, flag, value)
    if flag == "--seq-length":
        args = _with(args, "--max-position-embeddings", value)
    out = tmp_path / "out.json"
    with pytest.raises(CaptureError) as err:
        command.main([*args, *PLAN, "--memory-model", model_file, "--json", str(out)])
    text = str(err.value)
    assert (
        f"--memory-model {model_file} was fitted for a model of sequence 2048, hidden 2048" in text
    )
    assert "every prediction would be extrapolated from another model" in text
    assert "h 2048-2048" in text  # the probes' ranges
    assert not out.exists()


def test_the_model_it_was_fitted_for_is_planned(model_file, tmp_path):
    out = tmp_path / "plan.json"
    assert (
        plan_cli.main([*SMALL_ARGS, *PLAN, "--memory-model", model_file, "--json", str(out)]) == 0
    )
    assert json.loads(out.read_text())["fits"]


def test_another_version_is_refused(model_file, tmp_path):
    model = full_model(SMALL)
    old = dataclasses.replace(model, versions=("0.0.1", *model.versions[1:]))
    with pytest.raises(CaptureError, match="was fitted by capture-megatron 0.0.1"):
        check_fitted(old, SMALL, "m.json", "0.5.0")
    path = tmp_path / "old.json"
    write_model(old, str(path))
    with pytest.raises(CaptureError, match="fitted by capture-megatron 0.0.1 .*profile and fit"):
        plan_cli.main([*SMALL_ARGS, *PLAN, "--memory-model", str(path)])


def test_a_constant_the_predictor_does_not_know_is_refused(model_file, tmp_path):
    """A chunk's fitted constants are a sparse record of KindConstants' fields: a name that is not
    one (a renamed field, a hand-edited file) is refused when the file is read, not dropped."""
    data = json.loads(pathlib.Path(model_file).read_text())
    fields = data["variants"][0]["chunks"][0]["fields"]
    fields[0][0] = "saved_one"
    path = tmp_path / "renamed.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CaptureError, match="fitted constants .*'saved_one'.* are not each one"):
        plan_cli.main([*SMALL_ARGS, *PLAN, "--memory-model", str(path)])
