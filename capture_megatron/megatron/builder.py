"""Build this rank's model chunks (Megatron-Core GPTModel) for a ModelShape and a ParallelPlan.

Every pipeline rank gets its own TransformerConfig so that each stage can recompute a different
number of layers ('block' method); the pipeline layout (``--pipeline-model-parallel-layout``) places
uneven stages and virtual stages.

The caller names the Backend (megatron/backend.py): the CPU kernel set (the local spec, no fused
kernels: what runs on CPU); a real GPU, where the kernels set the fusions and the attention backend
as Megatron-LM's flags do and transformer_engine builds the TE spec; or the GPU kernel set emulated
on the fake-cuda device: the local spec with the modules of capture_megatron.emulate.gpu (what
TE's modules keep; see docs/MEMORY_MODEL.md). Nothing here asks which device is active.

The rest of the architecture goes to megatron-core as Megatron-LM's flags send it: GeGLU
(--geglu: gated_linear_unit with GELU), QKV biases, the norm epsilon, the RoPE base and Llama 3
scaling, the sliding window (window_size: the local spec's unfused softmax builds its mask; the GPU
kernel set's flash / cuDNN attention keep nothing for it). Mixture-of-experts models (--num-experts)
get Megatron's MoE fields and a decoder block spec mixing MoE and dense layers
(capture_megatron.megatron.moe), as Megatron-LM's gpt_builder builds them; multi-token prediction
layers (--mtp-num-layers) an MTP block on the last stage (capture_megatron.megatron.mtp).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from capture_megatron.config import Kernels, ModelShape, ParallelPlan
from capture_megatron.config.context import te_comm_type
from capture_megatron.config.training import BuildOptions
from capture_megatron.megatron import attention, moe, mtp
from capture_megatron.megatron.backend import Backend
from capture_megatron.megatron.gpu_spec import keep_fused_norms
from capture_megatron.megatron.norms import LocalNorm
from capture_megatron.rules.modelled import ddp_kernel_problem

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def te_available() -> bool:
    """True when Transformer Engine imports and a CUDA device is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def resolve_impl(requested: str) -> str:
    """The transformer implementation that will really be used ('local' or 'transformer_engine')."""
    if requested == "auto":
        return "transformer_engine" if te_available() else "local"
    if requested == "transformer_engine" and not te_available():
        from capture_megatron.errors import CaptureError

        raise CaptureError(
            "--transformer-impl transformer_engine: Transformer Engine is not importable "
            "or CUDA is absent; use --transformer-impl local"
        )
    return requested


def _defer_fields(plan: ParallelPlan, kernels: Kernels | None, fusion: bool) -> dict:
    """TransformerConfig's deferred output-layer weight gradient (refused where the kernels
    cannot run it: rules.modelled.ddp_kernel_problem)."""
    problem = ddp_kernel_problem(plan.ddp, "cpu" if kernels is None else "gpu", fusion)
    if problem:
        from capture_megatron.errors import CaptureError

        raise CaptureError(problem + ".")
    return {
        "defer_embedding_wgrad_compute": plan.ddp.defer_embedding_wgrad_compute,
        "wgrad_deferral_limit": plan.ddp.wgrad_deferral_limit,
    }


def kernel_fields(shape: ModelShape, kernels: Kernels | None) -> dict:
    """TransformerConfig's kernel fields: all fusions off for the CPU set (None), else as
    Megatron-LM's core_transformer_config_from_args derives them from its flags."""
    if kernels is None:
        return {
            "masked_softmax_fusion": False,
            "bias_activation_fusion": False,
            "bias_dropout_fusion": False,
            "apply_rope_fusion": False,
            "gradient_accumulation_fusion": False,
        }
    rope = shape.position_embedding_type == "rope"
    # GeGLU (capture-megatron's --geglu) fuses through megatron's bias_geglu_impl, which takes no
    # bias too: --no-bias-gelu-fusion turns it off, as it does the ungated GeLU's
    activation = (
        kernels.bias_swiglu_fusion
        if shape.swiglu
        else kernels.bias_gelu_fusion and (shape.add_bias_linear or shape.geglu)
    )
    return {
        "masked_softmax_fusion": kernels.masked_softmax_fusion,
        "bias_activation_fusion": activation,
        "bias_dropout_fusion": kernels.bias_dropout_fusion,
        "apply_rope_fusion": kernels.rope_fusion and rope,
        "attention_softmax_in_fp32": kernels.softmax_in_fp32,
        "apply_query_key_layer_scaling": kernels.apply_query_key_layer_scaling,
        "cross_entropy_loss_fusion": kernels.cross_entropy_loss_fusion,
        "cross_entropy_fusion_impl": kernels.cross_entropy_fusion_impl,
        "deterministic_mode": kernels.deterministic_mode,
        "gradient_accumulation_fusion": kernels.gradient_accumulation_fusion,
        **(
            {
                "moe_permute_fusion": kernels.moe_permute_fusion,
                "moe_router_fusion": kernels.moe_router_fusion,
            }
            if shape.moe.enabled
            else {}
        ),
    }


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's gelu_pytorch_tanh): the unfused GeGLU's gate."""
    return F.gelu(x, approximate="tanh")


def activation(shape: ModelShape, fused: bool):
    """TransformerConfig's activation_func: SiLU for SwiGLU; for GeGLU F.gelu when fused (megatron
    dispatches on it to bias_geglu_impl, the tanh approximation) else tanh-GELU; else F.gelu."""
    if shape.swiglu:
        return F.silu
    return gelu_tanh if shape.geglu and not fused else F.gelu


def _recompute_fields(shape: ModelShape, plan: ParallelPlan, pp_rank: int) -> dict:
    """TransformerConfig's recompute fields for one pipeline rank (its full-recompute layers;
    selective recompute's modules, the deprecated --moe-layer-recompute folded in). A probe
    without experts (the dense layers of a model with MoE layers) leaves `moe_act` out: it
    touches no dense layer, and the model's own config (with --moe-grouped-gemm, which the user
    input was checked for) is not the probe's."""
    n_recompute = plan.recompute.layers_on(pp_rank)
    full = plan.recompute.granularity == "full" and n_recompute > 0
    selective = plan.recompute.granularity == "selective"
    modules = [m for m in plan.recompute.selected if shape.moe.enabled or m != "moe_act"]
    return {
        "recompute_granularity": "full" if full else ("selective" if selective else None),
        "recompute_method": plan.recompute.method if full else None,
        "recompute_num_layers": n_recompute if full else None,
        "recompute_modules": modules if selective else None,
    }


def transformer_config(
    shape: ModelShape,
    plan: ParallelPlan,
    pp_rank: int,
    opts: BuildOptions = BuildOptions(),
    backend: Backend = Backend(),
) -> TransformerConfig:
    """Megatron TransformerConfig of one pipeline rank (recompute differs per rank)."""
    kernels = backend.kernels
    if kernels is None or kernels.transformer_impl == "local":
        attention.check_local_latents(shape, plan.tp)

    fields = kernel_fields(shape, kernels)
    config = attention.config_class(shape)(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.groups,
        ffn_hidden_size=shape.ffn,
        kv_channels=shape.head_dim,
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None,
        context_parallel_size=plan.cp,
        cp_comm_type=te_comm_type(plan, backend.te_attention),
        sequence_parallel=plan.sequence_parallel,
        pipeline_model_parallel_layout=plan.layout if plan.pp > 1 else None,
        params_dtype=TORCH_DTYPES[shape.dtype],
        pipeline_dtype=TORCH_DTYPES[shape.dtype],
        bf16=shape.dtype == "bf16",
        fp16=shape.dtype == "fp16",
        gated_linear_unit=shape.gated,
        activation_func=activation(shape, fields["bias_activation_fusion"]),
        normalization=shape.normalization,  # type: ignore[arg-type]  # a str ModelShape checks against the Literal
        layernorm_epsilon=shape.norm_epsilon,
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.add_qkv_bias,
        window_size=tuple(shape.window_size) or None,  # type: ignore[arg-type]  # ModelShape checks: two ints
        hidden_dropout=shape.hidden_dropout,
        attention_dropout=shape.attention_dropout,
        init_method_std=opts.init_method_std,
        # perform_initialization must stay True: Megatron's linear layers only mark their weights
        # tensor-parallel (partition_dim, for grad norms and SP) in that path; init_weights then
        # overwrites the values with the partition-independent ones.
        perform_initialization=True,
        use_cpu_initialization=False,
        persist_layer_norm=False,
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=True,
        **_recompute_fields(shape, plan, pp_rank),
        microbatch_group_size_per_vp_stage=plan.microbatch_group_size or None,
        cuda_graph_scope=[],  # the default "full" warns "deprecated"; [] is its same-meaning twin
        **moe.config_fields(shape, plan),
        **attention.config_fields(shape),
        **mtp.config_fields(shape),
        **fields,
        **_defer_fields(plan, kernels, fields["gradient_accumulation_fusion"]),
    )
    moe.routing_bound(config, shape)
    return config


def layer_spec(shape: ModelShape, backend: Backend):
    """The ModuleSpec of one transformer layer for the backend.

    The local spec's norms are replaced by LocalNorm (same torch modules, but usable with SP); on
    the fake-cuda device the GPU kernel set's modules replace what TE would build
    (capture_megatron.megatron.gpu_spec).
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    flags = attention.spec_flags(shape)
    if backend.real_te:  # no `normalization` argument: TE's TENorm reads config.normalization
        return specs.get_gpt_layer_with_transformer_engine_spec(**flags)
    spec = specs.get_gpt_layer_local_spec(normalization=shape.normalization, **flags)
    if backend.emulated:
        from capture_megatron.megatron.gpu_spec import gpu_layer_spec

        assert backend.kernels is not None
        return gpu_layer_spec(spec, backend.kernels, LocalNorm, shape.moe.moe_grouped_gemm)
    return local_norms(spec)


def local_norms(spec):
    """A layer spec of the local spec with every norm LocalNorm (megatron's L2Norm eager)."""
    layer = dataclasses.replace(
        spec.submodules,
        input_layernorm=LocalNorm,
        pre_mlp_layernorm=LocalNorm,
        self_attention=attention.attention_norms(spec.submodules.self_attention, LocalNorm),
    )
    return dataclasses.replace(spec, submodules=layer)


def block_spec(spec, backend: Backend, num_layers: int):
    """TransformerBlockSubmodules of one model chunk: `num_layers` layers and the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if backend.real_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=TENorm)  # type: ignore[arg-type]  # annotated a spec or an instance: megatron-core passes classes too
    norm = LocalNorm
    if backend.emulated:
        from capture_megatron.megatron.gpu_spec import layer_norm

        assert backend.kernels is not None
        norm = layer_norm(backend.kernels, LocalNorm)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=norm)  # type: ignore[arg-type]  # a class, as above


def build_gpt(
    shape: ModelShape,
    plan: ParallelPlan,
    config: TransformerConfig,
    backend: Backend,
    num_layers: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None,
) -> GPTModel:
    """One GPTModel chunk holding `num_layers` transformer layers (and the ends it is told to
    hold); with experts, megatron's decoder block spec for this rank and `vp_stage`. GPU kernels:
    on the GPU as Megatron-LM's get_model moves it (built on fake-cuda: fake parameters stay)."""
    from megatron.core.models.gpt import GPTModel

    from capture_megatron.emulate.cp_attention import with_context_parallel

    te_attention, emulated = backend.te_attention, backend.emulated
    if shape.moe.enabled:
        spec = moe.block_spec(config, shape, backend.real_te, vp_stage, num_layers)
        if backend.emulated:
            from capture_megatron.megatron.gpu_spec import gpu_block_spec

            assert backend.kernels is not None
            spec = gpu_block_spec(spec, backend.kernels, shape.moe.moe_grouped_gemm)
        layers = [with_context_parallel(s, plan, te_attention, emulated) for s in spec.layer_specs]  # type: ignore[union-attr]  # listed
        spec = dataclasses.replace(spec, layer_specs=[attention.latent_core(s) for s in layers])
    else:
        layer = with_context_parallel(layer_spec(shape, backend), plan, te_attention, emulated)
        spec = block_spec(attention.latent_core(layer), backend, num_layers)
    mtp_spec = None
    if post_process and shape.mtp_num_layers:  # the last stage (megatron's placement)
        last = spec.layer_specs[-1] if spec.layer_specs else None
        if shape.moe.enabled and last is None:  # no decoder layer here: the model's last one
            last = mtp.moe_layer_spec(config, shape, backend)
            last = attention.latent_core(with_context_parallel(last, plan, te_attention, emulated))
        mtp_spec = mtp.block_spec(shape, backend, last or attention.latent_core(layer))
    with torch.device("cuda") if backend.emulated else contextlib.nullcontext():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,  # type: ignore[arg-type]  # megatron-core takes block submodules too
            vocab_size=shape.padded_vocab(plan.tp),
            max_sequence_length=shape.max_positions,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not shape.untie_embeddings_and_output_weights,
            position_embedding_type=shape.position_embedding_type,  # type: ignore[arg-type]  # a str ModelShape checks against megatron-core's Literal
            rotary_base=shape.rotary_base,
            rope_scaling=shape.use_rope_scaling,
            rope_scaling_factor=shape.rope_scaling_factor,
            mtp_block_spec=mtp_spec,  # type: ignore[arg-type]  # megatron-core's own get_gpt_mtp_block_spec returns these submodules
            vp_stage=vp_stage,
        )
    if backend.kind == "gpu":
        model.cuda(torch.cuda.current_device())
    elif backend.emulated:  # the GPU kernel set: TE's fused norms are not recomputed
        assert backend.kernels is not None
        keep_fused_norms(model, backend.kernels)
    return model


def build_chunks(
    shape: ModelShape,
    plan: ParallelPlan,
    opts: BuildOptions = BuildOptions(),
    backend: Backend = Backend(),
    seed: int = 1234,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage), unwrapped GPTModels with initialised
    weights, built by `backend` (the CPU kernel set by default).

    Needs torch.distributed and megatron's parallel_state initialised for `plan`.
    """
    from megatron.core import parallel_state as ps

    from capture_megatron.megatron.init import init_weights

    pp_rank = ps.get_pipeline_model_parallel_rank()
    config = transformer_config(shape, plan, pp_rank, opts, backend)
    chunks = []
    for vp in range(plan.vpp):
        vp_stage = vp if plan.vpp > 1 else None
        model = build_gpt(
            shape,
            plan,
            config,
            backend,
            plan.chunks_of(pp_rank)[vp],
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        init_weights(model, shape, opts, seed)
        chunks.append(model)
    return chunks
