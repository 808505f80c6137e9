"""megatron-core's calls whose signature or behaviour differs between the supported series
(0.16.1 through 0.19.x, capture_megatron.config.versions): the adapter's one place for them.

Each function names the series where megatron-core changed; the rest of the adapter, profile/ and
train/ call these instead of megatron-core directly where it differs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from typing import Any

from capture_megatron.config import versions

MOE = "megatron.core.transformer.moe"
"""megatron-core's MoE package: modules of one series only are imported by name (mypy checks
this package against 0.16.1, the default leg's)."""


def backward_step(input_tensor: Any, output: Any, output_grad: Any, config: Any) -> Any:
    """megatron-core's pipeline backward_step: 0.16 takes a model_type (unused for GPT, None
    here) before the config; 0.17 dropped it."""
    from megatron.core.pipeline_parallel import schedules

    step: Any = schedules.backward_step  # the installed version's signature, not mypy's
    if versions.current() == versions.V0_16:
        return step(input_tensor, output, output_grad, None, config)
    return step(input_tensor, output, output_grad, config)


def offload_group_end() -> str:
    """The name of the fine-grained activation-offloading interface's call that ends a group:
    0.16's static ``group_commit(tensor, name, forced_released_tensors)``, 0.17's method
    ``group_offload(tensor, forced_released_tensors, delay_offload)`` (the group's name is the
    interface's)."""
    return "group_commit" if versions.current() == versions.V0_16 else "group_offload"


def reset_moe_trackers() -> None:
    """Empty megatron-core's global MoE loss tracker, which sizes its per-layer tensors by the
    first model that logs into it (a later probe with more layers would index past them): up to
    0.17 the layer-wise logging dict; from 0.18 the routers record into a MoEMetricsTracker
    (moe_logging, the dict deprecated), dropped here and created anew on the next record."""
    from megatron.core.transformer.moe import moe_utils

    if importlib.util.find_spec(f"{MOE}.moe_logging") is None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    else:
        importlib.import_module(f"{MOE}.moe_logging").destroy_moe_metrics_tracker()


def check_mla_query_norm(qk_layernorm: bool, q_lora: int | None) -> None:
    """CaptureError for multi-latent attention with --qk-layernorm and no --q-lora-rank on
    megatron-core 0.19: there the query norm is fused into linear_q_proj (a LayerNorm-linear on
    the layer's input: one more norm and its normalised input kept, Transformer Engine's on the
    GPU, none in the local spec); 0.16 builds no query norm without the LoRA rank. Not modelled
    yet, so refused rather than forecast as 0.16 builds it."""
    from capture_megatron.errors import CaptureError

    if qk_layernorm and q_lora is None and versions.current() >= versions.V0_19:
        raise CaptureError(
            "multi-latent attention with --qk-layernorm and no --q-lora-rank: megatron-core "
            f"{versions.megatron_core()} fuses a query norm into linear_q_proj (Transformer "
            "Engine's LayerNormColumnParallelLinear; the local spec has none), which is not "
            "modelled yet; give --q-lora-rank, or leave out --qk-layernorm"
        )


def submodules_of(spec: Any) -> Any:
    """The submodules of a layer-spec entry: a ModuleSpec's (0.16), or the `submodules` keyword
    of the functools.partial builder 0.19's specs use for MLPs, MoE layers and experts."""
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return getattr(spec, "submodules", None)


def with_submodules(spec: Any, submodules: Any) -> Any:
    """`spec` (a ModuleSpec or a 0.19 partial builder) with other submodules."""
    if isinstance(spec, functools.partial):
        return functools.partial(
            spec.func, *spec.args, **{**spec.keywords, "submodules": submodules}
        )
    return dataclasses.replace(spec, submodules=submodules)


def module_of(spec: Any) -> Any:
    """The class a layer-spec entry builds (a ModuleSpec's module, a partial builder's func)."""
    return spec.func if isinstance(spec, functools.partial) else getattr(spec, "module", spec)


def grouped_experts_spec(column: type, row: type) -> Any:
    """megatron-core's TEGroupedMLP over the GroupedLinear classes (column, row): 0.16 takes
    MLPSubmodules in a ModuleSpec, 0.19 GroupedMLPSubmodules in a partial builder."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    if versions.current() == versions.V0_16:
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec

        return ModuleSpec(
            module=TEGroupedMLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)
        )
    submodules = importlib.import_module(f"{MOE}.experts").GroupedMLPSubmodules
    return functools.partial(TEGroupedMLP, submodules=submodules(linear_fc1=column, linear_fc2=row))


def grouped_experts(experts: Any, grouped: bool | None) -> bool:
    """Whether the GPU kernel set builds an MoE layer's experts as TEGroupedMLP: on 0.16 where
    the local spec built its legacy GroupedMLP (what --moe-grouped-gemm gives there); 0.19's
    local spec always builds SequentialMLP, so there `grouped` (--moe-grouped-gemm) decides."""
    if versions.current() == versions.V0_16 or grouped is None:
        return module_of(experts).__name__ == "GroupedMLP"
    return grouped


def batch_on_this_cp_rank(batch: dict) -> dict:
    """megatron-core's get_batch_on_this_cp_rank: 0.19 asks whether context parallelism is
    hybrid (--hybrid-context-parallel, refused by flags.policy: False here) and takes the
    context-parallel group as given (None: the default group, where 0.16 looked up the CP
    group), so it is passed."""
    from megatron.core import parallel_state, utils

    slice_batch: Any = utils.get_batch_on_this_cp_rank  # the installed version's signature
    if versions.current() == versions.V0_16:
        return slice_batch(batch)
    group = parallel_state.get_context_parallel_group()
    return slice_batch(batch, is_hybrid_cp=False, cp_group=group)


def mtp_layer_field() -> str:
    """MultiTokenPredictionLayerSubmodules' field for the layer an MTP module runs: 0.16's
    transformer_layer, 0.17's mtp_model_layer."""
    return "transformer_layer" if versions.current() == versions.V0_16 else "mtp_model_layer"
