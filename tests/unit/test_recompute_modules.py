"""Issue 26: megatron-core 0.16.1's --recompute-modules (selective recompute of core_attn,
layernorm, mla_up_proj, mlp, moe, moe_act, shared_experts) and the deprecated
--moe-layer-recompute are read as megatron-core reads them, refused where its TransformerConfig
refuses them (one paragraph), keyed without changing the default variants' design-record keys,
kept and emitted by `plan` as given, and priced by the step-time model. Pure Python: no
profiling (the per-rank forecast on real runs is tests/dist/test_recompute_forecast.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from synthetic_memory import SMALL, synthetic_source

from capture_megatron.config import GIB, Cluster, Kernels, ParallelFlags, Recompute
from capture_megatron.config.kernels import kernel_set
from capture_megatron.config.presets import preset
from capture_megatron.errors import CaptureError
from capture_megatron.features.moe import Experts
from capture_megatron.flags import parser as flags
from capture_megatron.flags.resolve import parallel_plan, recompute
from capture_megatron.planner import PlanOptions, plan, plan_args, space_from
from capture_megatron.profile.design import variant_tps
from capture_megatron.profile.design_cache import design_key
from capture_megatron.records import Variant
from capture_megatron.rules.flags import UNMODELLED
from capture_megatron.rules.megatron import check_plan_fits_model
from capture_megatron.rules.modelled import refuse_on_fake_device
from capture_megatron.steptime.model import CostModel
from capture_megatron.steptime.parts import layer_time


def _flags(argv: list[str]) -> ParallelFlags:
    """ParallelFlags as the CLI parses them (argparse from the dataclass fields)."""
    parser = flags.FlagParser(prog="test")
    flags.add_parallel_flags(parser)
    return flags.from_namespace(ParallelFlags, flags.parse_flags(parser, argv))


def test_the_flags_parse_as_megatron_reads_them():
    given = _flags(["--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe"])
    assert given.recompute_modules == ("mlp", "moe")
    assert recompute(given, 2) == Recompute("selective", modules=("mlp", "moe"))
    assert Recompute("selective", modules=("mlp", "moe")).selected == ("mlp", "moe")
    assert Recompute("selective").selected == ("core_attn",)  # megatron-core's default
    assert "--recompute-modules" not in UNMODELLED  # declared by ParallelFlags, not refused


def test_the_deprecated_moe_layer_recompute_adds_moe_and_makes_recompute_selective():
    """megatron-core 0.16.1 (TransformerConfig.__post_init__): granularity selective, 'moe'
    appended to the modules (to the default core_attn when none are given)."""
    assert recompute(_flags(["--moe-layer-recompute"]), 1) == Recompute(
        "selective", modules=("core_attn", "moe")
    )
    both = _flags(["--moe-layer-recompute", "--recompute-modules", "mlp"])
    assert recompute(both, 1).selected == ("mlp", "moe")
    full = _flags(["--moe-layer-recompute", "--recompute-granularity", "full"])
    with pytest.raises(CaptureError, match="Do not set --moe-layer-recompute with full"):
        recompute(full, 1)


def test_an_unknown_module_is_refused_naming_megatrons_choices():
    with pytest.raises(CaptureError, match=r"--recompute-modules attn: .* allows only core_attn"):
        recompute(_flags(["--recompute-modules", "attn"]), 1)


@pytest.mark.parametrize(
    "module, named",
    [
        ("moe_act", "--recompute-modules moe_act needs --moe-grouped-gemm"),
        ("mla_up_proj", "--recompute-modules mla_up_proj needs --multi-latent-attention"),
    ],
)
def test_what_transformer_config_refuses_is_refused_in_one_paragraph(module, named):
    shape = dataclasses.replace(
        SMALL, moe=Experts(num_experts=4, moe_router_topk=2), add_bias_linear=False
    )
    given = _flags(["--recompute-granularity", "selective", "--recompute-modules", module])
    with pytest.raises(CaptureError, match=re.escape(named)) as err:
        parallel_plan(given, shape, 8)
    assert "\n" not in str(err.value)
    # megatron-core checks them for selective recompute only: under full they change nothing
    full = Recompute("full", "block", (1,), (module,))
    plan = dataclasses.replace(parallel_plan(ParallelFlags(), shape, 8), recompute=full)
    check_plan_fits_model(shape, plan)


@pytest.mark.parametrize("name", ["gpt3-1.3b", "llama2-7b"])
@pytest.mark.parametrize("sp, tp", [(False, 2), (True, 4)])
def test_default_variants_keep_their_design_keys_and_others_are_fitted_at_own_shapes(name, sp, tp):
    """The default modules (not given, or core_attn alone, in any order) key the variant as before
    the field existed (tests/unit/test_shipped_design.py finds the shipped files by that key);
    other modules are a variant of their own, fitted at the model's own shapes."""
    shape = preset(name)
    kernels = kernel_set("fake-cuda", Kernels().for_gpu())
    default = Variant.of(shape, "selective", sp)
    assert default.recompute_modules == () and default.designed
    assert Variant.of(shape, "selective", sp, modules=("core_attn", "core_attn")) == default
    assert Variant.of(shape, "full", sp, modules=("mlp",)).recompute_modules == ()
    key = design_key("fake-cuda", kernels, default, variant_tps(default, tp), True)
    other = Variant.of(shape, "selective", sp, modules=("mlp", "core_attn", "layernorm"))
    assert other.recompute_modules == ("core_attn", "layernorm", "mlp") and not other.designed
    assert design_key("fake-cuda", kernels, other, variant_tps(other, tp), True) != key
    assert Variant.from_json(other.to_json()) == other


def _plan_given(**given):
    space = space_from(ParallelFlags(**given))
    cluster = Cluster(gpus=8, gpu_memory_bytes=80 * GIB)
    options = PlanOptions(space=space, global_batch_size=32, context_gib=0)
    return plan(SMALL, cluster, options, synthetic_source)


def test_plan_keeps_and_emits_the_modules_as_given_and_they_parse_back():
    modules = ("mlp", "layernorm", "core_attn")
    result = _plan_given(recompute_granularity="selective", recompute_modules=modules)
    for e in result.ranked:
        assert e.plan.recompute == Recompute("selective", modules=modules)
    args = result.megatron_args()
    at = args.index("--recompute-modules")
    assert tuple(args[at + 1 : at + 4]) == modules
    back = _flags([a for a in plan_args(result.best.plan) if a != "--sequence-parallel"])
    assert recompute(back, result.best.plan.pp) == result.best.plan.recompute


def test_plan_hands_back_modules_given_without_a_granularity_whatever_it_chooses():
    """Megatron reads them only for selective recompute; a plan that chooses none or full still
    hands them back, and its selective candidates recompute them."""
    result = _plan_given(recompute_modules=("mlp",))
    assert result.megatron_args().count("--recompute-modules") == 1
    chosen = result.megatron_args()
    assert chosen[chosen.index("--recompute-modules") + 1] == "mlp"


def test_the_step_time_counts_each_recomputed_modules_forward():
    """Selective recompute re-runs its modules' forward in the backward: the attention core by
    default, more with the MLP and the norms; none without selective recompute."""
    base = parallel_plan(ParallelFlags(tensor_model_parallel_size=2), SMALL, 8)
    setting = CostModel().setting

    def redo(rc: Recompute) -> float:
        plan = dataclasses.replace(base, recompute=rc)
        return layer_time(setting, SMALL, plan).recomputed_forward

    attn = redo(Recompute("selective"))
    assert redo(Recompute()) == 0.0 and attn > 0
    mlp = redo(Recompute("selective", modules=("mlp",)))
    assert mlp > 0 and redo(Recompute("selective", modules=("core_attn", "mlp"))) == attn + mlp
    assert redo(Recompute("selective", modules=("core_attn", "mlp", "layernorm"))) > attn + mlp
    assert redo(Recompute("selective", modules=("moe",))) == 0.0  # a dense layer has no MoE


def test_fp8_with_other_modules_is_forecast_on_the_gpu_kernel_set():
    """Under FP8 megatron-core recomputes mlp, moe and shared_experts with TE's checkpoint
    (te_checkpoint: TE 5671fd36's _CheckpointFunction, reentrant, saving the tensor inputs as
    megatron's CheckpointFunction does) and the others with CheckpointWithoutOutput, which the
    GPU kernel set runs as megatron does: not refused."""
    kernels = dataclasses.replace(Kernels().for_gpu(), fp8_format="hybrid", fp8_recipe="tensorwise")
    for modules in (("mlp",), ("moe_act",), ("layernorm", "mlp")):
        variant = Variant.of(preset("llama2-7b"), "selective", True, modules=modules)
        refuse_on_fake_device(variant, "fake-cuda", kernels)
