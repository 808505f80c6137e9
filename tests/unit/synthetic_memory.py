"""A synthetic memory model for planner tests that must not profile: a ModelSource whose fits are
plain regressions with Korthikanti-like coefficients (bytes per term of the probe sizes), so
`plan()` runs in well under a second on any shape, TP and micro-batch. The numbers are plausible,
not measured: tests built on it check the planner's logic (what is kept, ranked, compared and
emitted), never a memory forecast."""

from __future__ import annotations

import dataclasses

from capture_megatron.config import ModelShape
from capture_megatron.fit import MemoryModel, Needs, shape_sizes
from capture_megatron.fit.model import ChunkModel, VariantModel
from capture_megatron.fit.regression import Regression
from capture_megatron.records import ProbeShape, Variant
from capture_megatron.version import __version__

Terms = dict[str, float]


def reg(term_set: str, terms: Terms) -> Regression:
    """A regression with these coefficients per term (e.g. {"b*s*h/t": 34.0})."""
    terms = terms or {"1": 0.0}
    return Regression(term_set, tuple(terms), tuple(terms.values()), 0.0, 0.0, 1)


def plus(*parts: Terms) -> Terms:
    """The sum of term dictionaries."""
    out: Terms = {}
    for part in parts:
        for k, c in part.items():
            out[k] = out.get(k, 0.0) + c
    return out


def layer_saved(v: Variant) -> Terms:
    """S: what one layer saves (a tenth is not split over TP without SP; selective recompute drops
    the attention scores)."""
    scores = {} if v.recompute == "selective" else {"b*a*s^2/t": 5.0}
    if v.sequence_parallel:
        return plus({"b*s*h/t": 34.0}, scores)
    return plus({"b*s*h": 10.0, "b*s*h/t": 24.0}, scores)


def hidden(v: Variant) -> Terms:
    """One hidden-state tensor per micro-batch (split over TP with SP)."""
    return {"b*s*h/t": 2.0} if v.sequence_parallel else {"b*s*h": 2.0}


def chunk(kind: str, v: Variant) -> ChunkModel:
    """A chunk's constants: layer temporaries of 4-6 b s h / t; at the head fp32 logits of
    4 b s V / t, saved, twice more at the forward's peak (softmax, loss) and once more at the
    backward's."""
    s = layer_saved(v)
    head = {"b*s*V/t": 4.0} if kind in ("last", "only") else {}
    inp = {"b*s": 16.0} if kind in ("first", "only") else hidden(v)
    fwd_extra, bwd_extra = {"b*s*h/t": 4.0}, {"b*s*h/t": 6.0}
    fields = {
        "input_bytes": reg("activation", inp),
        "saved1": reg("activation", plus(s, head)),
        "fwd1": reg("activation", plus(s, fwd_extra, head, head, head)),
        "bwd1": reg("activation", plus(bwd_extra, head)),
        "step1": reg("step", {"h*f/t": 4.0}),
        "fwdrc": reg("activation", plus(hidden(v), fwd_extra, head, head, head)),
        "bwdrc": reg("activation", plus(s, bwd_extra, head)),
        "bwdmix": reg("activation", plus(s, bwd_extra, head)),
        "buffers1": reg("buffer", {}),
    }
    if v.moe is not None:  # routing graphs retain inputs and gradients (predict.retained)
        fields |= retention(kind, v)
        fields["bwdrc2"] = reg("activation", plus(s, bwd_extra, head, hidden(v)))
    if kind != "middle":
        fields |= {
            "saved0": reg("activation", head),
            "fwd0": reg("activation", plus(head, head, head)),
            "bwd0": reg("activation", head),
            "step0": reg("step", {}),
            "buffers0": reg("buffer", {}),
        }
    emb, norm = reg("parameter", {"V*h/t": 1.0}), reg("parameter", {"h": 1.0})
    ends = {"first": (emb,), "last": (norm, emb), "only": (emb, norm), "middle": ()}[kind]
    return ChunkModel(kind, tuple(fields.items()), ends)


def retention(kind: str, v: Variant) -> dict[str, Regression]:
    """An MoE chunk's retained bytes: the received input and its gradient (middle / last), each
    recomputed layer's input and gradient; a further recomputed layer's backward holds one more
    hidden state; and its routing state per MoE layer."""
    h = hidden(v)
    two = plus(h, h)
    ends = kind in ("middle", "last")
    return {
        "ret1": reg("activation", two if ends else {}),
        "grad1": reg("activation", h if ends else {}),
        "retrc": reg("activation", two),
        "gradrc": reg("activation", {}),
        "retmix": reg("activation", plus(two, h) if ends else two),
        "gradmix": reg("activation", h if ends else {}),
        "ret2": reg("activation", plus(two, two)),
        # the dispatcher's routing state: fp32 probs and a bool map over 4 experts, int64 indices
        "state1": reg("activation", {"b*s": 4 * 5.0 + 2 * 8.0}),
    }


def variant_model(v: Variant) -> VariantModel:
    """The synthetic fits of one variant (no anchors: every shape is predicted by regression). An
    MoE variant's layers hold four experts' MLPs (routed: marked as experts) and save what a dense
    layer saves plus as much again times the probe's capacity factor (the routed experts')."""
    mlp = ({"h*f/t": 1.0}, {"h*f/t": 1.0})
    experts = 4 * mlp if v.moe is not None else mlp
    layer = tuple(
        reg("parameter", t)
        for t in ({"h": 1.0}, {"h*a*d/t": 3.0}, {"h*a*d/t": 1.0}, {"h": 1.0}) + experts
    )
    routed = (False,) * 4 + (True,) * len(experts) if v.moe is not None else ()
    saved = layer_saved(v)
    if v.moe is not None:
        factor = v.moe.experts.moe_expert_capacity_factor
        saved = plus(saved, {k: c * factor for k, c in saved.items()})
    kept = reg("activation", hidden(v)) if v.recompute == "full" else None
    return VariantModel(
        variant=v,
        anchors=(),
        layer_expert=routed,
        layer_saved=reg("activation", saved),
        layer_saved_rc=kept,
        layer_numels=layer,
        chunks=tuple(chunk(k, v) for k in ("first", "middle", "last", "only")),
        buffers=reg("buffer", {}),
        ranges=(),
        layer_saved_rc_next=kept,
    )


def with_anchors(vm: VariantModel, shapes: list[ProbeShape]) -> VariantModel:
    """The variant with its regressions' constants stored as anchors at `shapes` (as profiling
    stores the probed shapes'): predictions there skip the regressions."""
    sizes = {shape_sizes(s) for s in shapes}
    return dataclasses.replace(vm, anchors=tuple(vm.constants(z) for z in sizes))


def synthetic_source(needs: Needs) -> MemoryModel:
    """A ModelSource: the synthetic fits of every variant asked for, anchored at the probe shapes
    asked for (no profiling)."""
    variants = sorted({v for v, _ in needs}, key=repr)
    return MemoryModel(
        device="fake-cuda",
        kernels="gpu:synthetic",
        versions=(__version__, "none", "0.16.1"),
        variants=tuple(
            with_anchors(variant_model(v), [s for w, s in needs if w == v]) for v in variants
        ),
    )


def full_model(shape: ModelShape) -> MemoryModel:
    """The synthetic fits of every variant a search over `shape` can ask for (each recompute
    granularity, with and without sequence parallelism), anchored at TP 1-8 and micro-batches 1-2:
    for --memory-model files."""
    return synthetic_source(
        frozenset(
            (Variant.of(shape, rc, sp), ProbeShape.of(shape, tp, mbs))
            for rc in ("none", "selective", "full")
            for sp in (False, True)
            for tp in (1, 2, 4, 8)
            for mbs in (1, 2)
        )
    )


SMALL = ModelShape(
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=16,
    seq_length=2048,
    vocab_size=32000,
    dtype="bf16",
)
"""A 16-layer model whose plans on 8 GPUs of a few GiB (no CUDA context margin) need some
recompute: with TP 2, PP 4, micro-batch 1 and global batch 32, no recompute peaks at 4.4 GiB and
full recompute of every layer at 2.5 GiB."""
SMALL_ARGS = (
    "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --vocab-size 32000 --bf16 --hidden-dropout 0.1 "
    "--attention-dropout 0.1"
).split()
"""SMALL as Megatron flags."""
