"""Flags are declared once, on the dataclass fields they set: the parser, the reading back into the
dataclass and the writing out as flags are generated from them (capture_megatron.flags.parser)."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import (
    BuildOptions,
    CheckpointOptions,
    DataOptions,
    DdpOptions,
    ModelShape,
    OptimOptions,
    ParallelFlags,
    RunOptions,
)
from capture_megatron.errors import CaptureError
from capture_megatron.fields import field_docs, flagged_fields, to_flags
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import model_shape, shape_overrides
from capture_megatron.train.entry import build_parser

MEGATRON_CLASSES = (
    ModelShape,
    ParallelFlags,
    DdpOptions,
    OptimOptions,
    DataOptions,
    CheckpointOptions,
    RunOptions,
    BuildOptions,
)
"""Dataclasses whose flags are Megatron-LM's (one training parser holds them all)."""
OPTIONS = {
    OptimOptions: dict(
        lr=3e-4,
        min_lr=1e-5,
        lr_decay_style="cosine",
        lr_warmup_iters=5,
        weight_decay=0.1,
        clip_grad=0.5,
        adam_beta2=0.95,
        adam_eps=1e-6,
    ),
    DataOptions: dict(
        data_path=("0.3", "a_text_document", "0.7", "b_text_document"),
        split="98,1,1",
        tokenizer_type="GPT2BPETokenizer",
        vocab_file="v.json",
        merge_file="m.txt",
        eod_mask_loss=True,
    ),
    CheckpointOptions: dict(
        save="ckpt",
        load="ckpt",
        save_interval=50,
        no_load_optim=True,
        override_opt_param_scheduler=True,
    ),
    RunOptions: dict(
        train_iters=7,
        log_interval=2,
        seed=9,
        memory_report="m.json",
        distributed_backend="gloo",
        progress=False,
    ),
    DdpOptions: dict(
        overlap_grad_reduce=True,
        grad_reduce_in_bf16=True,
        use_precision_aware_optimizer=True,
        exp_avg_dtype="bf16",
        exp_avg_sq_dtype="fp8",
        main_params_dtype="fp16",
        num_distributed_optimizer_instances=2,
        ddp_num_buckets=4,
        ddp_pad_buckets_for_high_nccl_busbw=True,
    ),
    BuildOptions: dict(init_method_std=0.01),
}


def test_each_flag_is_declared_once():
    names = [spec.name for cls in MEGATRON_CLASSES for _, spec in flagged_fields(cls)]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    dests = [f.name for cls in MEGATRON_CLASSES for f, _ in flagged_fields(cls)]
    assert sorted(d for d in set(dests) if dests.count(d) > 1) == []


@pytest.mark.parametrize("cls", list(OPTIONS), ids=lambda c: c.__name__)
def test_objects_round_trip_through_their_flags(cls):
    obj = cls(**OPTIONS[cls])
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "8",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "4",
        *to_flags(obj),
    ]
    if cls is not DataOptions:
        argv.append("--mock-data")
    ns = flags.parse_flags(build_parser(), argv)
    assert flags.from_namespace(cls, ns) == obj
    assert to_flags(cls(**{} if cls is not DataOptions else {"mock_data": True})) == (
        ["--mock-data"] if cls is DataOptions else []
    )


def test_help_is_the_field_docstring():
    parser = build_parser()
    parser.show_all = True  # --help-all: the Megatron-LM groups, which --help only counts
    text = parser.format_help()
    for cls in (OptimOptions, RunOptions):
        for field, spec in flagged_fields(cls):
            first_words = " ".join(field_docs(cls)[field.name].split()[:3])
            assert spec.name in text and first_words in " ".join(text.split()), spec.name


def test_model_flags_given_are_told_from_defaults():
    parser = flags.FlagParser()
    flags.add_model_flags(parser)
    ns = parser.parse_args(["--num-layers", "4", "--swiglu", "--disable-bias-linear", "--bf16"])
    assert shape_overrides(ns) == {
        "num_layers": 4,
        "swiglu": True,
        "add_bias_linear": False,
        "dtype": "bf16",
    }
    with pytest.raises(CaptureError, match="--hidden-size is required"):
        model_shape(ns)
    full = parser.parse_args(
        [
            "--num-layers",
            "4",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--vocab-size",
            "100",
        ]
    )
    shape = model_shape(full)
    assert shape == ModelShape(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100
    )
    assert dataclasses.replace(shape, swiglu=True).swiglu


def test_required_and_unknown_flags_are_one_paragraph():
    with pytest.raises(
        CaptureError,
        match="Megatron-LM flags not supported by capture-megatron: "
        "--use-flash-attn; unknown arguments: --frobnicate",
    ):
        flags.parse_flags(build_parser(), ["--use-flash-attn", "--frobnicate"])
    with pytest.raises(CaptureError, match="invalid choice"):
        flags.parse_flags(build_parser(), ["--lr-decay-style", "sideways"])
