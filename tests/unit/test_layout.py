"""--pipeline-model-parallel-layout as megatron-core 0.16.1 reads it (issue 51): its repeat syntax
unrolled by megatron-core's own rules, shell-escaped values named with their unescaped form, and a
layout given with an agreeing --num-virtual-stages-per-pipeline-rank (Megatron-Bridge's DeepSeek-V3
recipes) accepted as megatron-core accepts it."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import ModelShape
from capture_megatron.config.layout import expand, parse_layout
from capture_megatron.config.parallel import ParallelFlags
from capture_megatron.errors import CaptureError
from capture_megatron.flags.resolve import parallel_plan, split_notes

LAYOUTS = (
    "Et|(tt|)*30mL",  # Megatron-Bridge's DeepSeek-V3 recipes (PP 8 x VPP 4)
    "Ettt|(tt|)*29,m|L",  # megatron-core's docstring example
    "Et*3|(tt|)*6mL",  # the functional tests' fine-grained offloading cases, unescaped
    "E|t*4|(t|)*3L",
    "E(t|)*2tL",
    "E,t,t|t,t,L",
)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_repeats_unroll_as_megatron_core_unrolls_them(layout):
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    ours = expand(layout).split("|")
    names = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
    assert [[names[c] for c in s] for s in ours] == [[t.name for t in s] for s in stages]


def test_nested_repeats_and_spaces_are_refused_as_megatron_core_refuses_them():
    # one pass of each pattern, as megatron-core: a nested group leaves characters it stops at
    with pytest.raises(CaptureError, match="are not E, t, m, L or"):
        parse_layout("E((t|)*2t|)*2L", 2)
    with pytest.raises(CaptureError, match=r"\[' '\]"):
        parse_layout("Et t|L", 2)


def test_a_shell_escaped_layout_is_refused_with_its_unescaped_form():
    yaml_value = r"Et*3\\|\\(tt\\|\\)*6mL"  # the functional tests' MODEL_ARGS, as written
    with pytest.raises(CaptureError) as err:
        parse_layout(yaml_value, 2, 15, 1)
    text = str(err.value)
    assert "'Et*3|(tt|)*6mL'" in text and "shell escapes" in text
    assert parse_layout("Et*3|(tt|)*6mL", 2, 15, 1) == (3, 2, 2, 2, 2, 2, 2, 0)


SHAPE = ModelShape(
    num_layers=61,
    hidden_size=256,
    ffn_hidden_size=512,
    num_attention_heads=8,
    vocab_size=1024,
    seq_length=128,
    mtp_num_layers=1,
)
BRIDGE = ParallelFlags(
    pipeline_model_parallel_size=8,
    pipeline_model_parallel_layout="Et|(tt|)*30mL",
    num_virtual_stages_per_pipeline_rank=4,
    micro_batch_size=1,
    global_batch_size=64,
)


def test_a_layout_with_an_agreeing_virtual_stage_count_runs_as_in_megatron_core():
    plan = parallel_plan(BRIDGE, SHAPE, 64)
    assert plan.vpp == 4 and plan.layers_per_stage[:2] == (1, 2) and plan.mtp_layers == 1
    (note,) = split_notes(BRIDGE)
    assert "Megatron-LM's pretrain_gpt.py takes only one of them" in note
    assert split_notes(dataclasses.replace(BRIDGE, num_virtual_stages_per_pipeline_rank=None)) == ()


def test_a_virtual_stage_count_the_layout_contradicts_is_refused():
    with pytest.raises(CaptureError, match="conflicts with --pipeline-model-parallel-layout"):
        flags = dataclasses.replace(BRIDGE, num_virtual_stages_per_pipeline_rank=2)
        parallel_plan(flags, SHAPE, 64)
