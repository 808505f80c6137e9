"""Which probes a model needs: its variants and its anchor shapes (torch-free)."""
from __future__ import annotations

from capture_megatron.config import ModelShape
from capture_megatron.profile.design import design_shapes, probes_for, variant_tps
from capture_megatron.profile.records import Probe
from capture_megatron.profile.records import ProbeShape, Variant


def model_variant(shape: ModelShape, recompute: str = "none", sequence_parallel: bool = False) -> Variant:
    """The Variant of a model under a recompute granularity and SP setting."""
    return Variant(dtype=shape.dtype, recompute=recompute, sequence_parallel=sequence_parallel,
                   swiglu=shape.swiglu, normalization=shape.normalization,
                   position_embedding_type=shape.position_embedding_type, add_bias_linear=shape.add_bias_linear,
                   dropout=shape.hidden_dropout > 0 or shape.attention_dropout > 0,
                   untied=shape.untie_embeddings_and_output_weights)


def tp_fits(shape: ModelShape, tp: int, sequence_parallel: bool) -> bool:
    """Whether Megatron can split `shape` over `tp` ranks."""
    ok = shape.num_attention_heads % tp == 0 and shape.groups % tp == 0 and shape.ffn % tp == 0
    return ok and (not sequence_parallel or (tp > 1 and shape.seq_length % tp == 0))


def anchor_shape(shape: ModelShape, tp: int, micro_batch_size: int) -> ProbeShape:
    """The probe shape of the model itself at one TP size and micro-batch size."""
    return ProbeShape(micro_batch_size=micro_batch_size, seq_length=shape.seq_length, hidden_size=shape.hidden_size,
                      num_attention_heads=shape.num_attention_heads, num_query_groups=shape.groups,
                      kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn, padded_vocab=shape.padded_vocab(tp),
                      tp=tp)


def model_probes(shape: ModelShape, variants: list[Variant], tps: list[int], micro_batch_sizes: list[int],
                 design: bool) -> list[Probe]:
    """Anchor probes of the model (every variant, valid TP and micro-batch size) plus, with `design`,
    the regression design shapes of each variant."""
    probes: list[Probe] = []
    for variant in variants:
        anchors = [anchor_shape(shape, t, b) for t in tps for b in micro_batch_sizes
                   if tp_fits(shape, t, variant.sequence_parallel)]
        shapes = anchors + (design_shapes(variant_tps(variant, max(tps))) if design else [])
        probes += probes_for(variant, shapes)
    return probes
