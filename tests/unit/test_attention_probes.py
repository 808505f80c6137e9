"""Probes of query/key-norm and multi-latent-attention variants (issue 26): fake-cpu measures what
the CPU measures; the probes' parameters are the static count of megatron-core's local spec (CPU)
and of Transformer Engine's (the GPU kernel set: MLA's down-projections whole on every TP rank);
the YaRN tables every MLA layer registers are measured as its layer buffers (4096 rows in the
model's dtype, s rows once fused RoPE has re-cached them)."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.features.mla import LatentAttention, attention_parameters
from capture_megatron.profile.probed import model_shape
from capture_megatron.profile.session import run_probes
from capture_megatron.records import Probe, ProbeShape, Variant

pytestmark = pytest.mark.slow

LLAMA_BF16_SP = Variant(
    dtype="bf16",
    recompute="selective",
    sequence_parallel=True,
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    dropout=False,
    untied=True,
)
LATENT = LatentAttention(
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
    rope_type="yarn",
)
QK_NORM = dataclasses.replace(LLAMA_BF16_SP, qk_norm="layernorm")
MLA = dataclasses.replace(LLAMA_BF16_SP, qk_norm="layernorm", mla=LATENT)
SHAPE = ProbeShape(2, 64, 64, 4, 4, 16, 192, 256, 2)


@pytest.mark.parametrize("variant", [QK_NORM, MLA], ids=["qk_layernorm", "mla"])
def test_fake_equals_cpu_for_a_small_shape(variant):
    keys = [Probe(variant, SHAPE, k, n) for k, n in (("first", 1), ("middle", 2), ("last", 1))]
    cpu = run_probes(keys, "cpu", progress=False)
    fake = run_probes(keys, "fake-cpu", progress=False)
    for a, b in zip(cpu, fake):
        for field in ("param_bytes", "optimizer_bytes", "backward_peak", "layer_buffer_bytes"):
            assert getattr(a, field) == getattr(b, field), (a.kind, field)
        for field in ("saved_bytes", "forward_peak"):  # RoPE's int32 scalar per layer in fake
            assert 0 <= getattr(b, field) - getattr(a, field) <= 4 * a.layers, (a.kind, field)


def _layer(shape, tp: int, te: bool) -> int:
    """One transformer layer's parameters on a TP rank: attention, SwiGLU MLP, two RMSNorms."""
    h, f = shape.hidden_size, shape.ffn
    return attention_parameters(shape, tp, te) + 2 * h * f // tp + f * h // tp + 2 * h


@pytest.mark.parametrize("device", ["cpu", "fake-cuda"])
def test_probed_parameters_and_yarn_tables(device):
    """A middle chunk of one MLA layer at TP 2: its parameters are the static count of the spec
    the device builds, and its registered YaRN tables are measured."""
    (record,) = run_probes([Probe(MLA, SHAPE, "middle", 1)], device, progress=False)
    shape = model_shape(Probe(MLA, SHAPE, "middle", 1))
    te = device == "fake-cuda"
    assert sum(record.param_numels) == _layer(shape, 2, te)
    assert record.param_bytes == 2 * sum(record.param_numels)  # bf16
    pe = LATENT.qk_pos_emb_head_dim
    # cos and sin of 4096 positions, cast to bf16 with the model (Float16Module); fused RoPE (the
    # GPU kernel set's default with RoPE positions) re-caches them for the sequence at the first
    # forward
    rows = SHAPE.seq_length if te else 4096
    assert record.layer_buffer_bytes == 2 * rows * pe * 2
