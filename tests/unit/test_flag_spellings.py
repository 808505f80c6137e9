"""plan, predict and train read every spelling of a Megatron-LM setting the same way (issue 56,
problem 5: `plan` dropped --num-layers-per-virtual-pipeline-stage without a word, planning without
it, while predict ran VPP 2 and train refused a value that does not divide the layers). Each
command line is given to all three: the plan each would run (plan searching what is not given,
on a synthetic memory model; predict; train's TrainConfig) has the same sizes, split and
recompute, or all three refuse it in the same words."""

from __future__ import annotations

import json

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.cli import predict as predict_cli
from capture_megatron.errors import CaptureError
from capture_megatron.fit import write_model
from capture_megatron.train.entry import parse_config

GPUS = ["--gpus", "8", "--gpu-memory-gib", "80", "--global-batch-size", "32", "--no-progress"]
PP4 = ["--pipeline-model-parallel-size", "4", "--micro-batch-size", "1"]


@pytest.fixture(scope="module")
def memory_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("spellings") / "memory_model.json")
    write_model(full_model(SMALL), path)
    return path


def _planned(command, flags: list[str], model: str, out) -> dict:
    argv = [*SMALL_ARGS, "--memory-model", model, *GPUS, *flags, "--json", str(out)]
    assert command.main(argv) == 0
    return json.loads(out.read_text())["plan"]


def _three(flags: list[str], model: str, tmp_path) -> tuple[dict, dict, dict]:
    """(plan's, predict's, train's) plan of one command line, as plan JSON dicts."""
    planned = _planned(plan_cli, flags, model, tmp_path / "plan.json")
    predicted = _planned(predict_cli, flags, model, tmp_path / "predict.json")
    trained = parse_config([*SMALL_ARGS, "--global-batch-size", "32", *flags, "--mock-data"], 8)
    return planned, predicted, json.loads(trained.plan.to_json())


VPP2 = {
    "layers per virtual stage": [*PP4, "--num-layers-per-virtual-pipeline-stage", "2"],
    "with =": ["--pipeline-model-parallel-size=4", "--micro-batch-size=1"]
    + ["--num-layers-per-virtual-pipeline-stage=2"],
    "virtual stages per rank": [*PP4, "--num-virtual-stages-per-pipeline-rank", "2"],
}


@pytest.mark.parametrize("flags", VPP2.values(), ids=VPP2.keys())
def test_every_spelling_of_vpp_gives_vpp_2_to_every_command(flags, memory_model, tmp_path):
    for p in _three(flags, memory_model, tmp_path):
        assert (p["pp"], p["vpp"], len(p["layers_per_stage"])) == (4, 2, 8), p


def test_plan_searches_a_pipeline_size_layers_per_virtual_stage_allow(memory_model, tmp_path):
    flags = ["--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1"]
    p = _planned(plan_cli, flags, memory_model, tmp_path / "plan.json")
    assert p["vpp"] == SMALL.num_layers // p["pp"] // 2 and p["pp"] > 1


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            [*PP4, "--num-layers-per-virtual-pipeline-stage", "3"],
            "--num-layers 16 is not a multiple of pipeline size 4 x "
            "--num-layers-per-virtual-pipeline-stage 3",
        ),
        (
            [*PP4, "--num-layers-per-virtual-pipeline-stage", "2"]
            + ["--num-virtual-stages-per-pipeline-rank", "2"],
            "cannot be set at the same time",
        ),
    ],
    ids=["not dividing", "both spellings"],
)
def test_what_one_command_refuses_every_command_refuses(flags, words, memory_model, tmp_path):
    for run in (
        lambda: _planned(plan_cli, flags, memory_model, tmp_path / "plan.json"),
        lambda: _planned(predict_cli, flags, memory_model, tmp_path / "predict.json"),
        lambda: parse_config([*SMALL_ARGS, "--global-batch-size", "32", *flags, "--mock-data"], 8),
    ):
        with pytest.raises(CaptureError, match=words.replace("(", r"\(")):
            run()


SAME = {
    "first/last stage layers": [*PP4, "--decoder-first-pipeline-num-layers", "1"]
    + ["--decoder-last-pipeline-num-layers", "3"],
    "recompute-activations": [*PP4, "--recompute-activations"],
    "granularity selective": [*PP4, "--recompute-granularity", "selective"],
    "tp and sp with =": [*PP4, "--tensor-model-parallel-size=2", "--sequence-parallel"],
}


@pytest.mark.parametrize("flags", SAME.values(), ids=SAME.keys())
def test_plan_predict_and_train_run_the_same_plan(flags, memory_model, tmp_path):
    planned, predicted, trained = _three(flags, memory_model, tmp_path)
    for key in ("tp", "pp", "vpp", "sequence_parallel"):
        assert planned[key] == predicted[key] == trained[key], key
    assert planned["recompute"]["granularity"] == trained["recompute"]["granularity"]
    if "--decoder-first-pipeline-num-layers" in flags:  # the split given is kept, not searched
        assert planned["layers_per_stage"] == trained["layers_per_stage"] == [1, 6, 6, 3]
    if "selective" in " ".join(flags) or "--recompute-activations" in flags:
        assert planned["recompute"]["granularity"] == "selective"
