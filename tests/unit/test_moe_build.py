"""Mixture-of-experts models in the builder: Megatron's MoE fields reach TransformerConfig, MoE and
dense layers sit where --moe-layer-freq and the pipeline layout put them, and what the CPU kernel
set cannot run is refused by flag before any process starts.

The placement test builds real megatron-core GPTModel chunks in this process as every rank of a
fake process group (collectives complete without data), so each rank's layers can be inspected."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
from test_cli_errors import TINY, cli, one_error

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.features.moe import Experts
from capture_megatron.megatron import builder, moe


def _shape(**experts) -> ModelShape:
    fields = dict(num_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
    return ModelShape(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        max_position_embeddings=32,
        vocab_size=512,
        add_bias_linear=False,
        moe=Experts(**{**fields, **experts}),
    )


def _plan(**fields) -> ParallelPlan:
    base = dict(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, layers_per_stage=(4,))
    return ParallelPlan(**{**base, **fields})


def test_cpu_refusals_name_each_flag():
    assert moe.cpu_refusals(_shape()) == []
    assert moe.cpu_refusals(dataclasses.replace(_shape(num_experts=0), add_bias_linear=True)) == []
    shape = dataclasses.replace(
        _shape(moe_grouped_gemm=True, moe_token_dispatcher_type="flex"), add_bias_linear=True
    )
    with pytest.raises(CaptureError) as err:
        moe.refuse_on_cpu(shape)
    text = str(err.value)
    for flag in ("--moe-grouped-gemm", "--moe-token-dispatcher-type flex", "--disable-bias-linear"):
        assert flag in text
    assert "\n" not in text


def test_train_refuses_before_launch(tmp_path):
    """`capture-megatron train` names the flags and exits 2 without starting torchrun."""
    extra = "--mock-data --num-experts 4 --moe-grouped-gemm --moe-token-dispatcher-type flex"
    done = cli(["train", "--nproc", "2", *TINY, *extra.split()], str(tmp_path))
    error = one_error(done, "train")
    assert "--moe-grouped-gemm" in error and "flex" in error and "--disable-bias-linear" in error
    assert "torch.distributed" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(moe_router_topk=1), "--moe-router-topk 1 with softmax scores needs"),
        (
            dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01),
            "sinkhorn routing has no aux loss",
        ),
    ],
)
def test_router_settings_megatron_refuses(fields, expected):
    with pytest.raises(CaptureError, match=expected):
        Experts(num_experts=4, **fields)
    Experts(num_experts=4, moe_router_topk=1, moe_router_pre_softmax=True)


def test_config_fields_as_megatron_lm_sends_them():
    dense = builder.transformer_config(_shape(num_experts=0), _plan(), 0)
    assert dense.num_moe_experts is None and dense.moe_ffn_hidden_size is None
    config = builder.transformer_config(
        _shape(moe_layer_freq="([0]*1+[1]*3)", moe_aux_loss_coeff=0.01), _plan(), 0
    )
    assert config.num_moe_experts == 4 and config.moe_layer_freq == [0, 1, 1, 1]
    assert config.moe_ffn_hidden_size == 256 and config.moe_expert_capacity_factor is None
    assert config.moe_shared_expert_intermediate_size is None and config.moe_router_dtype is None
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_aux_loss_coeff == 0.01
    every_other = builder.transformer_config(_shape(moe_layer_freq="2"), _plan(ep=1), 0)
    assert every_other.moe_layer_freq == 2
    capped = builder.transformer_config(
        _shape(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), _plan(), 0
    )
    assert capped.moe_expert_capacity_factor == 1.0 and capped.moe_pad_expert_input_to_capacity


def _layers_on(rank: int, world: int, shape: ModelShape, plan: ParallelPlan) -> list:
    """(layer number, is MoE, local experts) of every layer rank `rank` builds for `plan`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from capture_megatron.emulate import cpu_compat

    cpu_compat.apply("cpu")
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(
            pipeline_model_parallel_size=plan.pp,
            virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None,
            expert_model_parallel_size=plan.ep,
            create_gloo_process_groups=False,
        )
        model_parallel_cuda_manual_seed(1)
        out = []
        for chunk in builder.build_chunks(shape, plan):
            for layer in chunk.decoder.layers:
                experts = getattr(layer.mlp, "experts", None)
                local = len(experts.local_experts) if experts is not None else 0
                out.append((layer.layer_number, isinstance(layer.mlp, MoELayer), local))
        return out
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_moe_layers_follow_pattern_and_layout():
    """PP2 x VPP2 with an uneven layout, EP2 over DP2: every rank holds the layers the layout
    gives it, MoE exactly where --moe-layer-freq says, two of the four experts each."""
    shape = _shape(moe_layer_freq="([0]*1+[1]*3)")
    plan = _plan(pp=2, dp=2, vpp=2, ep=2, global_batch_size=2, layers_per_stage=(1, 2, 1, 0))
    assert plan.layout == "Et|tt|t|L"
    pattern = shape.moe_layers
    expected = {0: [1, 4], 1: [2, 3]}  # stage i sits on pipeline rank i % pp
    for rank in range(4):  # megatron's order: TP, then DP (with EP), then PP
        built = _layers_on(rank, 4, shape, plan)
        pp_rank = rank // 2
        assert [n for n, _, _ in built] == expected[pp_rank]
        assert [m for _, m, _ in built] == [pattern[n - 1] for n in expected[pp_rank]]
        assert all(local == (2 if m else 0) for _, m, local in built)


@pytest.mark.parametrize("grouped", [False, True])
def test_fake_gpu_kernel_set_builds_te_experts(grouped):
    """On the GPU kernel set an MoE layer gets TE's norms and gathers; grouped-GEMM experts become
    megatron's TEGroupedMLP on the emulated GroupedLinear (the local spec's legacy GroupedMLP needs
    the grouped_gemm package), sequential experts keep megatron's linear layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from capture_megatron.config import Kernels, versions
    from capture_megatron.emulate.gpu.grouped import ColumnGroupedLinear, RowGroupedLinear
    from capture_megatron.emulate.gpu.norm import TENorm
    from capture_megatron.megatron.gpu_spec import gpu_layer_spec
    from capture_megatron.megatron.norms import LocalNorm
    from capture_megatron.megatron.versioned import module_of, submodules_of

    # megatron-core 0.16's local spec builds its legacy GroupedMLP (and warns); 0.19's builds
    # SequentialMLP whatever --moe-grouped-gemm says, which the kernel set is told
    legacy = grouped and versions.current() == versions.V0_16
    with pytest.warns(UserWarning, match="legacy GroupedMLP") if legacy else nullcontext():
        local = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=grouped)
    te = Kernels(transformer_impl="transformer_engine")
    layer = gpu_layer_spec(local, te, LocalNorm, grouped)
    parts = layer.submodules
    assert parts.input_layernorm is TENorm and parts.pre_mlp_layernorm is TENorm
    experts = submodules_of(parts.mlp).experts
    if grouped:
        assert module_of(experts) is TEGroupedMLP
        assert submodules_of(experts).linear_fc1 is ColumnGroupedLinear
        assert submodules_of(experts).linear_fc2 is RowGroupedLinear
    else:
        assert module_of(experts) is SequentialMLP
    shared_fc1 = submodules_of(submodules_of(parts.mlp).shared_experts).linear_fc1
    assert shared_fc1.__name__ == "TEColumnParallelLinear"


def test_expert_tp_other_than_tp_needs_ep():
    """megatron-core 0.16.1 reduces expert gradients over the dense DP group when EP is 1: an
    expert TP other than TP would train wrong gradients (measured), so it is refused."""
    from capture_megatron.rules.megatron import check_plan_fits_model

    for plan in (
        _plan(tp=2, dp=1, etp=1, sequence_parallel=True),
        _plan(dp=2, etp=2, global_batch_size=2),
    ):
        with pytest.raises(CaptureError, match=r"ETP \d differs from TP \d with EP 1"):
            check_plan_fits_model(_shape(), plan)
    check_plan_fits_model(_shape(), _plan(dp=4, ep=2, etp=2, global_batch_size=4))
    check_plan_fits_model(
        _shape(), _plan(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True, global_batch_size=2)
    )


def test_dense_probes_of_a_moe_model_leave_moe_act_out():
    """megatron-core 0.16.1 refuses recompute_modules moe_act without moe_grouped_gemm; the model's
    own config has grouped experts (Megatron-LM's gpt3_moe_..._fine_grained_offloading recipes:
    dense first layers, --recompute-modules layernorm mla_up_proj mlp moe_act), but a probe of its
    dense layers has no experts at all, and moe_act touches none of them."""
    from capture_megatron.config import Recompute

    modules = ("layernorm", "mlp", "moe_act")
    plan = _plan(recompute=Recompute(granularity="selective", modules=modules))
    dense = builder.transformer_config(_shape(num_experts=0), plan, 0)
    assert dense.recompute_modules == ["layernorm", "mlp"]
    grouped = builder.transformer_config(_shape(moe_grouped_gemm=True), plan, 0)
    assert grouped.recompute_modules == list(modules)
