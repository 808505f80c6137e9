"""Never a traceback: every command line in tests/data -- Megatron-LM's functional tests (with the
world size of their H100 recipe), its example launch lines, the Megatron MoE Model Zoo configs,
the Megatron-Bridge H100 recipes -- given to `predict` (the launch lines to `plan` too), and every
published config.json given to `plan --hf-config`, ends in a forecast or in one paragraph
(CaptureError, exit 2).

Both tests are slow (make test, not test-fast). The first: the parse and refusal stage
(bench/inputs.py's dry stage: everything before the first profile), every input and command.
The second: the whole `predict` forecast of every functional test and
every launch line, profiling on the spot (GPU kernel set, fake CUDA tensors). The whole forecast of
`plan` over the launch lines and the HF configs is bench/inputs.py --forecast's (minutes per large
model: bench/results/inputs.json); tests/unit/test_paste.py and test_hf_today.py plan samples of
them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench" / "inputs.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_inputs", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


INPUTS = _bench()
ITEMS = INPUTS.corpus()
PREDICTED = [i for i in ITEMS if i.command == "predict" and i.set != "hf_configs"]
"""Every functional test and every launch line, given to `predict`."""


def test_the_corpus_holds_every_input_set():
    sets = {i.set for i in ITEMS}
    assert sets == set(INPUTS.SETS)
    names = {s: {i.name for i in ITEMS if i.set == s} for s in sets}
    assert len(names["functional_tests"]) >= 70 and len(names["megatron_bridge"]) == 13
    assert len(names["moe_modelzoo"]) == 6 and len(names["megatron_lm_examples"]) == 8
    lines = [i for i in ITEMS if i.set != "hf_configs" and i.set != "functional_tests"]
    assert {i.command for i in lines} == {"predict", "plan"}  # each line through both


def _check(row):
    assert row["outcome"] != "traceback", f"{row['name']}: {row['reason']} at {row['where']}"
    if row["outcome"] == "refused":
        assert "\n" not in row["reason"].strip(), row["reason"]  # one paragraph


@pytest.mark.slow  # about 45 s: every input (both commands) up to the first profile
def test_every_input_is_refused_in_one_paragraph_or_goes_on_to_be_forecast(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path / "cache"))
    for item in ITEMS:
        _check(INPUTS.run(item, forecast=False))


@pytest.mark.slow
@pytest.mark.xdist_group("forecasts")  # with the other forecasts: tests/conftest.py
@pytest.mark.parametrize("item", PREDICTED, ids=lambda i: f"{i.set}:{i.command}:{i.name}")
def test_every_launch_line_is_predicted_or_refused(item, monkeypatch, forecast_cache):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", forecast_cache)
    row = INPUTS.run(item, forecast=True)
    _check(row)
    assert row["outcome"] in ("accepted", "refused")
