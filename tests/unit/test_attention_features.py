"""Query/key norms and multi-latent attention (issue 26): Megatron-LM's flags read into the
ModelShape and emitted back (a plan round-trips), what megatron-core refuses of them refused by
flag, the memory-model variant keyed by them, and the parameter counts of the real megatron-core
model (local spec, TP 1 and 2) equal to the static count (config.attention.attention_parameters,
config.hf.parameter_count)."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.cli.plan import build_parser
from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.config import versions as mcore
from capture_megatron.config.hf import parameter_count
from capture_megatron.errors import CaptureError
from capture_megatron.features.mla import LatentAttention, attention_parameters
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import model_shape
from capture_megatron.planner import model_args
from capture_megatron.records import Variant

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --vocab-size 250"
)
MLA = (
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
    "--qk-pos-emb-head-dim 8 --v-head-dim 12"
)
LINES = {
    "qk-layernorm": "--qk-layernorm --normalization RMSNorm --group-query-attention "
    "--num-query-groups 2 --position-embedding-type rope --swiglu --disable-bias-linear",
    "qk-l2-norm": "--qk-l2-norm --kv-channels 24",
    "mla": f"{MLA} --qk-layernorm --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707",
    "mla-no-q-lora": f"{MLA.replace('--q-lora-rank 32', '--q-lora-rank 0')} --rope-type rope "
    "--position-embedding-type rope",
}


def _shape(line: str) -> ModelShape:
    return model_shape(
        flags.parse_flags(build_parser(), [*f"{BASE} {line}".split(), "--gpus", "1"])
    )


@pytest.mark.parametrize("name", sorted(LINES))
def test_flags_round_trip_through_model_args(name):
    shape = _shape(LINES[name])
    again = model_shape(flags.parse_flags(build_parser(), [*model_args(shape), "--gpus", "1"]))
    assert again == shape


def test_flags_reach_the_shape():
    mla = _shape(LINES["mla"]).mla
    assert (mla.q_lora, mla.kv_lora_rank, mla.q_head_dim, mla.v_head_dim) == (32, 16, 24, 12)
    assert (mla.rotary_scaling_factor, mla.mscale, mla.rope) == (40.0, 0.707, "yarn")
    assert _shape(LINES["mla-no-q-lora"]).mla.q_lora is None
    assert _shape(LINES["mla-no-q-lora"]).mla.rope == "rope"
    assert _shape(LINES["qk-layernorm"]).qk_norm == "layernorm"
    assert _shape(LINES["qk-l2-norm"]).qk_norm == "l2"


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        (f"{MLA} --group-query-attention --num-query-groups 2", "mutually exclusive"),
        (f"{MLA} --qk-l2-norm", "--qk-l2-norm is not supported with multi-latent"),
        ("--rope-type yarn", "--rope-type yarn needs --multi-latent-attention"),
        ("--qk-layernorm --qk-l2-norm", "two query/key norms"),
    ],
)
def test_what_megatron_refuses_is_refused_by_flag(line, shown):
    with pytest.raises(CaptureError, match=shown):
        _shape(line)


def test_the_variant_is_keyed_by_the_features_and_fitted_at_the_model_shapes():
    plain = Variant.of(_shape(""))
    norm, mla = Variant.of(_shape(LINES["qk-layernorm"])), Variant.of(_shape(LINES["mla"]))
    assert plain.designed and not norm.designed and not mla.designed
    assert norm.qk_norm == "layernorm" and mla.mla is not None
    # the YaRN scaling changes values, not tensors: one memory model for every scaling
    assert mla.mla.rotary_scaling_factor == 1.0 and mla.mla.kv_lora_rank == 16
    assert mla.mla.rope_type == "yarn"  # Megatron-LM's default for MLA, named
    assert Variant.from_json(mla.to_json()) == mla


def _built(shape: ModelShape, tp: int):
    """(per-layer self-attention parameters, all parameters) of the chunk TP rank 0 builds."""
    from capture_megatron.emulate import cpu_compat
    from capture_megatron.megatron import builder
    from capture_megatron.profile.groups import fake_job

    cpu_compat.apply("cpu")
    plan = ParallelPlan(
        tp=tp, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, layers_per_stage=(2,)
    )
    with fake_job(tp, 1):
        (model,) = builder.build_chunks(shape, plan)
        attention = model.decoder.layers[0].self_attention
        return sum(p.numel() for p in attention.parameters()), [
            p.numel() for p in model.parameters()
        ]


SHAPES = {
    "qk-layernorm-gqa": LINES["qk-layernorm"],
    "qk-layernorm-LayerNorm": "--qk-layernorm",
    "qk-l2-norm": LINES["qk-l2-norm"],
    "mla-q-lora-qk-layernorm": LINES["mla"],
    "mla-no-q-lora": LINES["mla-no-q-lora"],
    "mla-no-q-lora-latent-norm": LINES["mla-no-q-lora"] + " --qk-layernorm",
    "mla-without-latent-norms": MLA + " --normalization RMSNorm",
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_built_parameters_equal_the_static_count(name, tp):
    shape = _shape(SHAPES[name])
    if name == "mla-no-q-lora-latent-norm" and mcore.current() >= mcore.V0_19:
        with pytest.raises(CaptureError, match="fuses a query norm into linear_q_proj"):
            _built(shape, tp)  # megatron-core 0.19 builds another model: refused, not modelled
        return
    attention, every = _built(shape, tp)
    assert attention == attention_parameters(shape, tp)
    if tp == 1:  # the whole model, at the vocabulary as built
        built = dataclasses.replace(shape, vocab_size=shape.padded_vocab(1))
        assert sum(every) == parameter_count(built)


def test_local_latents_must_split_over_tp():
    shape = _shape(MLA.replace("--q-lora-rank 32", "--q-lora-rank 30"))
    with pytest.raises(CaptureError, match="--q-lora-rank 30 not divisible by TP 4"):
        from capture_megatron.megatron.attention import check_local_latents

        check_local_latents(shape, 4)
    check_local_latents(shape, 2)


def test_latent_attention_is_validated():
    with pytest.raises(CaptureError, match="--kv-lora-rank 0 must be positive"):
        LatentAttention(multi_latent_attention=True, kv_lora_rank=0)
