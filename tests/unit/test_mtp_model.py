"""Multi-token prediction (--mtp-num-layers): layouts with MTP layers ('m') as megatron-core parses
and validates them, the plan's flags, what is refused, and (slow) the parameters megatron-core
builds against the static model: parameter_count and the forecast's static bytes."""

from __future__ import annotations

import pytest

from capture_megatron.config import ModelShape, ParallelFlags, ParallelPlan
from capture_megatron.config.hf import parameter_count
from capture_megatron.config.layout import format_layout, parse_layout
from capture_megatron.config.parallel import Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.flags.resolve import parallel_plan
from capture_megatron.planner.emit import model_args, plan_args
from capture_megatron.rules.megatron import mtp_problems

SHAPE = ModelShape(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    max_position_embeddings=32,
    vocab_size=256,
    mtp_num_layers=2,
    untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def _megatron_standalone(layout: str, pp: int, layers: int, mtp: int) -> bool:
    """megatron-core's own parse and validation of `layout` (asserts when invalid); whether it
    calls the MTP placement 'standalone' (MTP off the last rank)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    return PipelineParallelLayerLayout(layout, pp).validate_layer_layout(layers, mtp)


@pytest.mark.parametrize(
    ("layers", "pp", "mtp"),
    [((2, 2), 2, 1), ((3, 1), 2, 2), ((2, 0), 2, 1), ((1, 1, 1, 1), 2, 3), ((4,), 1, 1)],
)
def test_plan_layouts_place_mtp_last_and_megatron_accepts_them(layers, pp, mtp):
    vpp = len(layers) // pp
    plan = ParallelPlan(1, pp, 1, 1, 4, layers, vpp=vpp, mtp_layers=mtp)
    layout = plan.layout
    assert layout == format_layout(layers, mtp) and layout.endswith("m" * mtp + "L")
    assert parse_layout(layout, pp, sum(layers), mtp) == layers
    assert _megatron_standalone(layout, pp, sum(layers), mtp) is False
    assert "--pipeline-model-parallel-layout" not in plan_args(plan) or layout in plan_args(plan)


@pytest.mark.parametrize(
    ("layout", "pp", "mtp", "named"),
    [
        ("Ett|ttL", 2, 1, "places 0 multi-token prediction layers (m) but --mtp-num-layers is 1"),
        ("Ett|ttmmL", 2, 1, "places 2 multi-token prediction layers"),
        ("Ett|tmtL", 2, 1, "must all sit at the end of the last stage"),
        ("Ettm|ttL", 2, 1, "--mtp-standalone"),
    ],
)
def test_misplaced_mtp_layers_are_refused_by_name(layout, pp, mtp, named):
    with pytest.raises(CaptureError, match="pipeline-model-parallel-layout") as err:
        parse_layout(layout, pp, 4, mtp)
    assert named in str(err.value)


def test_megatron_calls_mtp_on_another_rank_standalone():
    """The layout of megatron-core's own docstring (MTP on the second-last rank, the loss alone on
    the last) is what it calls standalone, and what parse_layout refuses."""
    layout = "Ettt|(tt|)*2,m|L"
    assert _megatron_standalone(layout, 5, 7, 1) is True
    with pytest.raises(CaptureError, match="--mtp-standalone"):
        parse_layout(layout, 5, 7, 1)


def test_flags_give_the_mtp_layout_and_the_model_flags_name_mtp():
    flags = ParallelFlags(pipeline_model_parallel_size=2)
    plan = parallel_plan(flags, SHAPE, world_size=2)
    assert plan.mtp_layers == 2 and plan.layout == "Ett|ttmmL"
    layout = "Ettt|tmmL"
    given = ParallelFlags(pipeline_model_parallel_size=2, pipeline_model_parallel_layout=layout)
    assert parallel_plan(given, SHAPE, world_size=2).layers_per_stage == (3, 1)
    args = model_args(SHAPE)
    assert args[args.index("--mtp-num-layers") + 1] == "2"


def test_the_emitted_flags_train_the_same_model():
    from capture_megatron.train.entry import parse_config

    batch = ["--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data"]
    plan = ParallelPlan(1, 2, 1, 1, 2, (3, 1), mtp_layers=2)
    config = parse_config([*model_args(SHAPE), *plan_args(plan), *batch], world_size=2)
    assert config.shape == SHAPE and config.plan.layers_per_stage == (3, 1)
    assert config.plan.layout == "Ettt|tmmL"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"recompute": Recompute("full", "uniform", (1, 1))}, "--recompute-method uniform"),
        ({"cp": 2}, "--context-parallel-size 2 with --mtp-num-layers"),
        ({"mtp_layers": 1}, "places 1 MTP layers but --mtp-num-layers is 2"),
    ],
)
def test_what_is_not_modelled_with_mtp_is_named(change, named):
    plan = ParallelPlan(1, 2, 2, 2, 4, (2, 2), mtp_layers=2).replace(**change)
    assert any(named in p for p in mtp_problems(SHAPE, plan))
    assert not mtp_problems(SHAPE, ParallelPlan(1, 2, 2, 2, 4, (2, 2), mtp_layers=2))


def test_an_mtp_only_last_stage_is_forecast():
    """A last stage of MTP layers alone (`...|mL`, Megatron-LM's MTP offloading case) is
    accepted: its 0-layer probe has no final norm, as megatron-core builds that stage; with
    fine-grained offloading its MTP layers offload their groups as the model's last layer's."""
    from capture_megatron.forecast.chunks import _offloaded
    from capture_megatron.forecast.layers import Layers

    assert not mtp_problems(SHAPE, ParallelPlan(1, 2, 2, 2, 4, (4, 0), mtp_layers=2))

    class _Dense(Layers):
        def __init__(self) -> None:  # only the layer pattern is read
            pass

        def chunk(self, start, k):
            return (False,) * k

    assert _offloaded(_Dense(), SHAPE, "last", ()) == (False, False)  # 2 MTP layers
    assert _offloaded(_Dense(), SHAPE, "middle", (False,)) == (False,)
    assert _offloaded(_Dense(), SHAPE.replace(mtp_num_layers=0), "last", (False,)) == (False,)


def test_the_planner_leaves_the_mtp_stage_a_decoder_layer():
    from capture_megatron.planner.balance import mtp_last_layer as _mtp_last_layer

    assert _mtp_last_layer(SHAPE, (3, 1, 0), 1) == (3, 0, 1)
    assert _mtp_last_layer(SHAPE, (4, 0, 0, 0), 2) == (2, 0, 0, 2)
    assert _mtp_last_layer(SHAPE, (2, 2), 1) == (2, 2)
    assert _mtp_last_layer(SHAPE.replace(mtp_num_layers=0), (4, 0), 1) == (4, 0)


def test_checkpoints_megatron_core_cannot_write_are_refused_before_training():
    """Tied embeddings with MTP at PP > 1: megatron-core 0.16.1's sharded_state_dict asserts on
    the last stage's output weight, so --save / --load are refused by name; untied they train."""
    from capture_megatron.train.entry import parse_config

    tied = [*model_args(SHAPE), "--micro-batch-size", "1", "--mock-data"]
    tied.remove("--untie-embeddings-and-output-weights")
    pp2 = ["--pipeline-model-parallel-size", "2"]
    with pytest.raises(CaptureError, match="--untie-embeddings-and-output-weights"):
        parse_config([*tied, *pp2, "--save", "ckpt"], world_size=2)
    assert parse_config([*tied, *pp2], world_size=2).plan.pp == 2  # no checkpoint: trains
    assert parse_config([*tied, "--save", "ckpt"], world_size=1).plan.pp == 1  # PP 1: saves
    untied = [*model_args(SHAPE), "--micro-batch-size", "1", "--mock-data", *pp2]
    assert parse_config([*untied, "--load", "ckpt"], world_size=2).checkpoint.load == "ckpt"


PREDICT_REFUSALS = {
    # name: (flags beside a small GPT with --mtp-num-layers 1, what the one paragraph names)
    "uniform": (
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "--recompute-method uniform with --mtp-num-layers",
    ),
    "standalone": ("--mtp-standalone", "--mtp-standalone"),
    "layout": (
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ettm|ttL",
        "--mtp-standalone",
    ),
    "no_m": (
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttL",
        "but --mtp-num-layers is 1",
    ),
}


@pytest.mark.parametrize("name", sorted(PREDICT_REFUSALS))
def test_predict_refuses_what_is_not_modelled_with_mtp_in_one_paragraph(name, tmp_path):
    from test_cli_errors import cli, one_error

    extra, named = PREDICT_REFUSALS[name]
    gpt = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 512"
    argv = ["predict", *gpt.split(), "--mtp-num-layers", "1", *extra.split(), "--gpus", "2"]
    line = one_error(
        cli([*argv, "--micro-batch-size", "1", "--no-progress"], str(tmp_path)), "predict"
    )
    assert named in line, line


def test_mtp_adds_its_layers_to_the_parameter_count():
    """Each MTP layer: two norms, eh_proj [2h -> h] without bias, a transformer layer like the
    decoder's, and a final norm; the embedding and output layer are shared."""
    h, plain = 64, SHAPE.replace(mtp_num_layers=0)
    norm = 2 * h  # LayerNorm: weight and bias
    layer = (parameter_count(plain.replace(num_layers=5)) - parameter_count(plain)) // 1
    assert parameter_count(SHAPE) - parameter_count(plain) == 2 * (layer + 2 * h * h + 3 * norm)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_built_parameters_equal_the_static_model(tied):
    """Probes of the MTP variant (CPU, megatron-core's real GPTModel): the one-stage model holds
    parameter_count's parameters; the last stage of PP 2 the decoder layers, the final norm, the
    MTP layers, an embedding copy and the output layer (tied: megatron-core's unused output weight
    too), and the forecast's static bytes of any last stage equal the built one's."""
    from capture_megatron.fit import fit
    from capture_megatron.forecast import predict
    from capture_megatron.profile.design import probes_for
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import Probe, ProbeShape, Variant

    shape = SHAPE.replace(untie_embeddings_and_output_weights=not tied, normalization="RMSNorm")
    variant = Variant.of(shape)
    size = ProbeShape.of(shape, 1, 2)
    records = run_probes(probes_for(variant, [size]), "cpu", progress=False)
    deep = run_probes([Probe(variant, size, "last", 3), Probe(variant, size, "only", 4)], "cpu")
    vocab = size.padded_vocab * 64
    only = sum(deep[1].param_numels)
    assert only == parameter_count(shape.replace(vocab_size=size.padded_vocab))
    per_layer = (parameter_count(shape.replace(num_layers=5)) - parameter_count(shape)) // 1
    # 3 of the 4 decoder layers, everything else of the one-stage model (the embedding copy with
    # its position table included), and with tied weights megatron-core's unused output weight
    expected_last = only - per_layer + (vocab if tied else 0)
    assert sum(deep[0].param_numels) == expected_last
    model = fit(records)
    plan = ParallelPlan(1, 2, 1, 2, 2, (1, 3), mtp_layers=2)
    stages = predict(model, shape.replace(vocab_size=size.padded_vocab), plan)
    assert stages[1].params == 4 * sum(deep[0].param_numels)  # fp32


@pytest.mark.slow
@pytest.mark.parametrize("device", ["fake-cpu", "fake-cuda"])
def test_both_kernel_sets_build_the_mtp_layers_on_the_last_stage(device):
    """On the CPU kernel set and the GPU kernel set (fake CUDA: TE's norms and gathering column
    linear stand in for TENorm and TEColumnParallelLinear) a last stage with one MTP layer at TP 2
    + SP holds exactly the embedding copy (V/t x h), two norms, eh_proj (2h x h/t), one more
    decoder layer's TP shard and a final norm more than without MTP, and keeps more activations."""
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import Probe, ProbeShape, Variant

    shape = SHAPE.replace(
        mtp_num_layers=1,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        dtype="bf16",
    )
    size = ProbeShape.of(shape, 2, 2)
    with_mtp = Variant.of(shape, "selective", sequence_parallel=True)
    without = Variant.of(shape.replace(mtp_num_layers=0), "selective", sequence_parallel=True)
    probes = [Probe(with_mtp, size, "last", 1), Probe(without, size, "last", 1)]
    mtp, plain, middle = run_probes(
        [*probes, Probe(without, size, "middle", 1)], device, progress=False
    )
    h, t = 64, 2
    extra = size.padded_vocab // t * h + 3 * h + 2 * h * h // t + sum(middle.param_numels)
    assert sum(mtp.param_numels) - sum(plain.param_numels) == extra
    assert mtp.saved_bytes > plain.saved_bytes + middle.saved_bytes
