"""Issue 2 / must-show 5: bad input is one paragraph naming the values, exit code 2, no traceback."""
from __future__ import annotations

import pytest
from harness import TINY, cli

CASES = {
    "layout": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|tttL", "--mock-data"],
               "places 5 transformer layers but --num-layers is 8"),
    "heads_tp": (["--tensor-model-parallel-size", "3", "--mock-data"], "heads 4 (query groups 4) not divisible by TP 3"),
    "world": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--mock-data"],
              "world size 2 is not divisible by TP 2 x PP 2"),
    "batch": (["--global-batch-size", "15", "--mock-data"], "--global-batch-size 15 is not divisible by --micro-batch-size 2 x DP 2"),
    "data": (["--data-path", "/nonexistent/corpus_text_document"], "/nonexistent/corpus_text_document"),
    "flag": (["--mock-data", "--use-flash-attn", "--frobnicate"], "--use-flash-attn"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_train_rejects_with_one_paragraph(name, tmp_path):
    extra, expected = CASES[name]
    done = cli(["train", "--nproc", "2", *TINY, *extra], cwd=str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert len(done.stderr.strip().splitlines()) == 1


def test_unknown_flag_names_both_kinds(tmp_path):
    done = cli(["train", "--nproc", "1", *TINY, "--mock-data", "--use-flash-attn", "--frobnicate"], cwd=str(tmp_path))
    assert "Megatron-LM flags not supported by capture-megatron: --use-flash-attn" in done.stderr
    assert "unknown arguments: --frobnicate" in done.stderr
