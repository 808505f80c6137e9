"""MoE checkpoints, the parts checked without training (the end-to-end reshard is in
tests/dist/test_moe.py): a resume into other expert weights is refused, and the optimizer's common
state is rewritten between megatron-core's one-optimizer (EP 1) and two-optimizer (EP > 1)
layouts with the saved Adam step and grad scaler."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.features.moe import Experts
from capture_megatron.train.checkpoint.rechain import chain_length, rechain, saved_step
from capture_megatron.train.resume import SavedRun, check_experts

SHAPE = ModelShape(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=512,
    add_bias_linear=False,
    moe=Experts(num_experts=4),
)
PLAN = ParallelPlan(
    tp=1, pp=1, dp=2, ep=2, micro_batch_size=1, global_batch_size=2, layers_per_stage=(4,)
)


def _saved(shape: ModelShape) -> SavedRun:
    common = {"shape": shape.to_json(), "plan": PLAN.to_json()}
    return SavedRun.from_common("ckpt/iter_0000003", common)


def test_resume_needs_the_same_expert_weights():
    check_experts(_saved(SHAPE), SHAPE)  # EP may differ; the weights are the same
    for other in (
        dataclasses.replace(SHAPE, moe=Experts(num_experts=8)),
        dataclasses.replace(SHAPE, moe=Experts(num_experts=4, moe_layer_freq="2")),
        dataclasses.replace(SHAPE, moe=Experts(num_experts=4, moe_ffn_hidden_size=128)),
        dataclasses.replace(SHAPE, moe=Experts()),
    ):
        with pytest.raises(CaptureError, match="--load ckpt/iter_0000003: the checkpoint's model"):
            check_experts(_saved(SHAPE), other)


def _groups(expert: bool, step=None) -> list[dict]:
    groups = [
        {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": expert, "lr": 5e-4},
        {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": expert, "lr": 5e-4},
    ]
    return [dict(g, step=step) for g in groups] if step is not None else groups


def test_chained_fp32_state_into_one_optimizer():
    saved = {
        0: {"state": {"common_step": 3}, "param_groups": _groups(False)},
        1: {"state": {"common_step": 3}, "param_groups": _groups(True)[:1]},
    }
    template = {"param_groups": _groups(False)}  # a fresh optimizer: no step yet
    out = rechain(saved, template)
    assert chain_length(saved) == 2 and chain_length(out) == 1
    assert out == {"param_groups": _groups(False), "state": {"common_step": 3}}


def test_one_distributed_optimizer_into_a_chain():
    saved = {"optimizer": {"param_groups": _groups(False, step=3)}, "grad_scaler": {"scale": 8.0}}
    template = {
        0: {"optimizer": {"param_groups": _groups(False, step=1)}, "grad_scaler": {"scale": 1.0}},
        1: {"optimizer": {"param_groups": _groups(True, step=1)[:1]}, "grad_scaler": {}},
    }
    out = rechain(saved, template)
    assert chain_length(out) == 2 and saved_step(out[0]) == saved_step(out[1]) == 3
    assert all(g["step"] == 3 for part in out.values() for g in part["optimizer"]["param_groups"])
    assert out[1]["optimizer"]["param_groups"][0]["is_expert_parallel"] is True
    assert out[0]["grad_scaler"] == out[1]["grad_scaler"] == {"scale": 8.0}
    assert rechain(template, template) is template  # the same chain: read unchanged
