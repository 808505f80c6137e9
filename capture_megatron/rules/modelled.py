"""What each kernel set, device and memory model describes: a run outside it is refused with the
reason before anything is profiled. Pure Python.

Sliding windows (window_problem): the cpu kernel set builds the window: the local spec's unfused
softmax makes its [s, s] mask each forward, and the profiler measures it. The GPU kernel set models
Transformer Engine's flash and cuDNN fused attention, which take the window as a kernel argument
and keep nothing for it; it does not emulate the masks TE's unfused attention or the local spec's
softmax build for a window, so a model with a window is refused with those kernels, never planned
as if it had none.

Multi-latent attention under the GPU kernels (latent_problem): Transformer Engine's FlashAttention
2 does not run it, megatron-core refuses fused RoPE with plain rope for it, and its context-parallel
attention is not modelled.
"""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.config import versions as mcore_versions
from capture_megatron.config.context import ALL_GATHER
from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.kernels import TE_FUSED_BACKENDS, Kernels, kernel_set
from capture_megatron.errors import CaptureError
from capture_megatron.features.fp8 import MODELLED_RECIPES
from capture_megatron.features.optimizer_offload import OffloadSettings
from capture_megatron.records import Variant
from capture_megatron.rules.flags import (
    activation_offload_problem,
    delay_wgrad_problem,
    tp_overlap_stops,
)
from capture_megatron.rules.megatron import flex_problems, fsdp_problems


def check_plans(
    shape: ModelShape,
    kernels: Kernels,
    kernel_set: str,
    best: ParallelPlan,
    cps: tuple[int, ...],
    cp_comm_type: str,
) -> None:
    """Refuse what the memory model's `kernel_set` does not describe of the plans a search chose
    (`best` the first, `cps` their context-parallel sizes, `cp_comm_type` the one searched): the
    rules of check_request at their sizes, and the gradient settings' kernels."""
    problem = (
        fp8_problem(kernel_set, kernels)
        or tp_overlap_problem(kernel_set, kernels, best.tp, best.sequence_parallel)
        or window_problem(shape, kernel_set, kernels)
        or latent_problem(shape, kernel_set, kernels, max(cps))
        or context_problem(cps, cp_comm_type, kernel_set, kernels)
        or ddp_kernel_problem(best.ddp, kernel_set, kernels.gradient_accumulation_fusion)
    )
    if problem:
        raise CaptureError(problem + ".")


def check_request(
    shape: ModelShape,
    kernels: Kernels,
    ddp: DdpOptions,
    cps: tuple[int, ...],
    cp_comm_type: str,
    fixed: ParallelPlan | None,
    kernel_set: str,
) -> None:
    """Refuse FP8, a sliding window or a context-parallel attention the kernels' memory model
    does not hold before profiling (`kernel_set` '': a memory model is given, whose kernel set
    the planner checks), and --optimizer-cpu-offload with FP8 parameters and
    --delay-wgrad-compute without Transformer Engine as Megatron-LM does.
    `cps`: the context-parallel sizes searched (or given); `fixed`: the plan, when given."""
    offload = kernels_offload_problem(ddp, kernels)
    offload = offload or delay_wgrad_problem(ddp, kernels.transformer_impl)
    offload = offload or fsdp_problem(ddp, kernel_set, kernels.fp8_param_gather)
    if offload:
        raise CaptureError(offload + ".")
    if not kernel_set:
        return
    tp, sp = (fixed.tp, fixed.sequence_parallel) if fixed is not None else (0, True)
    problem = (
        fp8_problem(kernel_set, kernels)
        or tp_overlap_problem(kernel_set, kernels, tp, sp)
        or window_problem(shape, kernel_set, kernels)
        or latent_problem(shape, kernel_set, kernels, max(cps or (1,)))
        or context_problem(cps, cp_comm_type, kernel_set, kernels)
    )
    if problem:
        raise CaptureError(problem + ".")


def window_problem(shape: ModelShape, kernel_set: str, kernels: Kernels) -> str:
    """Why the model's sliding window is not modelled under `kernels` on `kernel_set` ('cpu' or
    'gpu:...', capture_megatron.config.kernels.kernel_set); '' when it is."""
    if not shape.window_size or not kernel_set.startswith("gpu"):
        return ""
    gpu = kernels.for_gpu()
    if gpu.transformer_impl == "transformer_engine" and gpu.attention_backend in TE_FUSED_BACKENDS:
        return ""
    return (
        f"--window-size {','.join(map(str, shape.window_size))} with --transformer-impl "
        f"{gpu.transformer_impl} --attention-backend {gpu.attention_backend}: that unfused "
        "attention builds sliding-window masks the GPU memory model does not hold; use "
        "--transformer-impl transformer_engine with --attention-backend flash, fused or auto, "
        "under which the window changes no memory"
    )


def latent_problem(shape: ModelShape, kernel_set: str, kernels: Kernels, cp: int = 1) -> str:
    """Why the model's multi-latent attention is not modelled (or not run by megatron-core) under
    `kernels` on `kernel_set`; '' when it is."""
    mla = shape.mla
    if not mla.enabled or not kernel_set.startswith("gpu"):
        return ""
    gpu = kernels.for_gpu()
    te = gpu.transformer_impl == "transformer_engine"
    if te and gpu.attention_backend == "flash" and mla.q_head_dim != mla.v_head_dim:
        return (
            "--multi-latent-attention with --attention-backend flash: Transformer Engine's "
            "FlashAttention 2 does not run query/key heads wider than value heads (MLA), and "
            "FlashAttention 3 is not modelled; use --attention-backend fused, auto or unfused"
        )
    rope = shape.position_embedding_type == "rope" and gpu.rope_fusion
    if rope and mla.rope == "rope":
        return (
            "--multi-latent-attention with --rope-type rope and fused RoPE: megatron-core's "
            "MLATransformerConfig refuses it (apply_rope_fusion for MLA only works with YaRN); "
            "give --no-rope-fusion or --rope-type yarn"
        )
    if cp > 1:
        return (
            f"--multi-latent-attention with --context-parallel-size {cp}: Transformer Engine's "
            "context-parallel attention over MLA's unequal head widths is not modelled yet"
        )
    return ""


def fp8_problem(kernel_set: str, kernels: Kernels) -> str:
    """Why FP8 training under `kernels` is not forecast on `kernel_set` ('cpu' or 'gpu:...',
    capture_megatron.config.kernels.kernel_set); '' when it is (or when the run is not FP8)."""
    if not kernels.fp8:
        return ""
    given = f"--fp8-format {kernels.fp8_format} --fp8-recipe {kernels.fp8_recipe}"
    if not kernel_set.startswith("gpu"):
        return (
            f"{given}: FP8 training runs Transformer Engine's FP8 GEMMs, which only the GPU kernel "
            "set models (what TE keeps on an H100: FP8 copies of the linear layers' inputs and "
            "weights, their scales); the CPU kernel set describes CPU runs, which have no FP8 "
            "kernels. Predict it on the GPU kernel set: --device fake-cuda (TE's kernels emulated "
            "on fake CUDA tensors, the default without a GPU) or --device cuda"
        )
    gpu = kernels.for_gpu()
    if gpu.transformer_impl != "transformer_engine":
        return (
            f"{given} with --transformer-impl {gpu.transformer_impl}: FP8 GEMMs are Transformer "
            "Engine's; megatron's local layers ignore FP8, which is not modelled: use "
            "--transformer-impl transformer_engine"
        )
    if kernels.fp8_recipe not in MODELLED_RECIPES:
        return (
            f"{given}: a custom recipe's quantizers (--fp8-quantizer-factory) keep tensors of "
            "their own, not modelled; use delayed, tensorwise, mxfp8 or blockwise"
        )
    if kernels.fp8_recipe == "mxfp8" and kernels.fp8_param_gather:
        return (
            f"{given} --fp8-param-gather: TE cannot move MXFP8 parameters into DDP's buffer "
            "(replace_raw_data raises for MXFP8Tensor), so Megatron-LM needs "
            "--reuse-grad-buf-for-mxfp8-param-ag, whose shared parameter / gradient buffer is not "
            "modelled yet; leave --fp8-param-gather out, or use the delayed, tensorwise or "
            "blockwise recipe"
        )
    if kernels.first_last_layers_bf16:
        return (
            f"{given} with --first-last-layers-bf16: layers kept in bf16 among FP8 layers are not "
            "modelled yet; leave it out to forecast every layer in FP8"
        )
    if not kernel_set.split("/").count(f"fp8-{kernels.fp8_recipe}"):
        return (
            f"{given}: the memory model ({kernel_set}) describes a run without FP8; profile the "
            "FP8 kernels (leave out --memory-model)"
        )
    return ""


def tp_overlap_problem(kernel_set: str, kernels: Kernels, tp: int = 0, sp: bool = True) -> str:
    """Why --tp-comm-overlap under `kernels` is not forecast on `kernel_set` ('cpu' or
    'gpu:...') for a plan of TP `tp` with sequence parallelism `sp` (tp 0: not known yet); ''
    when it is, or without it."""
    if not kernels.tp_comm_overlap:
        return ""
    if not kernel_set.startswith("gpu"):
        return (
            "--tp-comm-overlap: TP communication overlap runs through Transformer Engine's "
            "userbuffers (CUDA memory outside the caching allocator, GEMMs writing into it), "
            "which only the GPU kernel set models; the CPU kernel set describes CPU runs, which "
            "have none. Predict it on the GPU kernel set: --device fake-cuda (the default "
            "without a GPU) or --device cuda"
        )
    if kernels.for_gpu().transformer_impl != "transformer_engine":
        return "--tp-comm-overlap needs --transformer-impl transformer_engine (TE's userbuffers)"
    if kernels.tp_comm_overlap_cfg:
        return (
            f"--tp-comm-overlap-cfg {kernels.tp_comm_overlap_cfg}: a userbuffer configuration "
            "changes each buffer's method, size and precision, not modelled; leave it out to "
            "forecast Transformer Engine's defaults"
        )
    return tp_overlap_stops(tp, sp)


RING = ("", "p2p")
"""--cp-comm-type values the GPU kernel set models ('' when not given: Megatron-LM's p2p)."""


def context_problem(cps: tuple[int, ...], comm_type: str, kernel_set: str, kernels: Kernels) -> str:
    """Why context parallelism at the sizes `cps` with --cp-comm-type `comm_type` is not
    modelled on `kernel_set` under `kernels`; '' when it is (or no size is above 1)."""
    if max(cps, default=1) == 1:
        return ""
    if not kernel_set.startswith("gpu"):
        if comm_type in ALL_GATHER:
            return ""
        return (
            f"--cp-comm-type {comm_type} is not modelled: the CPU kernel set's context-parallel "
            "attention all-gathers K and V; give --cp-comm-type allgather or leave the flag out"
        )
    gpu = kernels.for_gpu()
    te = gpu.transformer_impl == "transformer_engine"
    if not (te and gpu.attention_backend in TE_FUSED_BACKENDS):
        return (
            f"--context-parallel-size {max(cps)} with --transformer-impl {gpu.transformer_impl} "
            f"--attention-backend {gpu.attention_backend} is not modelled: Megatron's local "
            "attention and Transformer Engine's unfused backend do not run context parallelism; "
            "use --transformer-impl transformer_engine with --attention-backend flash, fused or "
            "auto"
        )
    if comm_type in RING:
        return ""
    return (
        f"--cp-comm-type {comm_type} is not modelled: the GPU memory model emulates Transformer "
        "Engine's ring context-parallel attention (p2p, Megatron-LM's default) only; give "
        "--cp-comm-type p2p or leave the flag out"
    )


def trainer_kernels_problem(kernels: Kernels) -> str:
    """Why capture-megatron's own training cannot run `kernels` ('' when it can): FP8."""
    if not kernels.fp8:
        return ""
    return (
        f"--fp8-format {kernels.fp8_format}: capture-megatron's training does not run FP8 "
        "(Transformer Engine's FP8 GEMMs need a GPU with TE, and its build does not set up FP8 "
        "parameters); `predict` and `plan` forecast FP8 runs on the GPU kernel set: train them "
        "with Megatron-LM"
    )


def refuse_on_fake_device(variant: Variant, device: str, kernels: Kernels) -> None:
    """CaptureError for what a fake device cannot model: on fake-cuda context parallelism
    without TE's flash or fused attention (Megatron's local attention and TE's unfused backend
    do not run it) and grouped-GEMM experts with linear biases (the kernel set's GroupedLinear
    has none)."""
    problem = context_problem((variant.cp,), "", "gpu", kernels) if device == "fake-cuda" else ""
    problem = problem or _fp8_device_problem(device, kernels)
    problem = problem or _overlap_device_problem(device, kernels)
    problem = problem or _flex_device_problem(variant, device)
    if problem:
        raise CaptureError(problem)
    grouped = variant.moe is not None and variant.moe.experts.moe_grouped_gemm
    if device == "fake-cuda" and grouped and variant.add_bias_linear:
        raise CaptureError(
            "--moe-grouped-gemm with linear biases is not modelled on the GPU kernel set (its "
            "emulation of Transformer Engine's GroupedLinear has no biases); give "
            "--disable-bias-linear, or leave out --moe-grouped-gemm"
        )


def _flex_device_problem(variant: Variant, device: str) -> str:
    """Why a flex-dispatcher probe of `variant` cannot run on `device` ('' when it can, or
    without flex): the CPU kernel set has no DeepEP / HybridEP, a real GPU would need them
    installed (probing there is not implemented), and the fake-cuda rules of
    capture_megatron.features.dispatch."""
    moe = variant.moe
    if moe is None or moe.experts.moe_token_dispatcher_type != "flex":
        return ""
    if device == "cuda":
        return (
            "--moe-token-dispatcher-type flex: flex probes run on the GPU kernel set's emulation "
            "of HybridEP (--device fake-cuda); probing DeepEP / HybridEP on a real GPU is not "
            "implemented yet"
        )
    if mcore_versions.current() >= mcore_versions.V0_19:
        return (
            f"--moe-token-dispatcher-type flex on megatron-core {mcore_versions.megatron_core()}: "
            "the GPU kernel set emulates HybridEP as megatron-core 0.16 calls it; 0.19's "
            "dispatch (its permute blocks, padding and pre-processing) is not emulated yet"
        )
    cpu, group = device != "fake-cuda", moe.ep * moe.etp
    # NVLink domains are the planner's check (capture_megatron.planner.run): a probe's group
    # counts as one domain here
    problems = flex_problems(moe.experts, variant.dtype, group, group, cpu=cpu)
    return "; ".join(problems)


def _fp8_device_problem(device: str, kernels: Kernels) -> str:
    """Why FP8 probes of `kernels` cannot run on `device` ('' when they can, or without FP8)."""
    if not kernels.fp8:
        return ""
    if device == "cuda":
        return (
            f"--fp8-format {kernels.fp8_format}: FP8 probes run on the GPU kernel set's emulation "
            "(--device fake-cuda); probing FP8 with Transformer Engine on a real GPU is not "
            "implemented yet"
        )
    return fp8_problem(kernel_set(device, kernels), kernels)


def _overlap_device_problem(device: str, kernels: Kernels) -> str:
    """Why --tp-comm-overlap probes cannot run on `device` ('' when they can, or without it)."""
    if kernels.tp_comm_overlap and device == "cuda":
        return (
            "--tp-comm-overlap: its probes run on the GPU kernel set's emulation (--device "
            "fake-cuda); probing TE's userbuffers on a real GPU is not implemented yet"
        )
    return tp_overlap_problem(kernel_set(device, kernels), kernels)


def ddp_kernel_problem(ddp: DdpOptions, kernel_set: str, accumulation_fusion: bool) -> str:
    """Why the kernel set cannot run these gradient and optimizer settings ('' when it can): the
    combined 1F1B schedule of --overlap-moe-expert-parallel-comm needs CUDA streams; deferring
    the output layer's weight gradient needs gradient-accumulation fusion (megatron-core's
    ModelParallelConfig), a CUDA extension (apex / TE) the CPU kernel set does not have."""
    offload = activation_offload_problem(ddp.activation_offload, kernel_set)
    offload = offload or fsdp_problem(ddp, kernel_set, False)
    if offload:
        return offload
    if ddp.cuda_graphs.enabled and kernel_set == "cpu":
        return (
            f"--cuda-graph-impl {ddp.cuda_graphs.impl}: CUDA graphs need CUDA, which the CPU "
            "kernel set does not run: predict them with the GPU kernel set (--device fake)"
        )
    if ddp.overlap_moe_expert_parallel_comm and kernel_set == "cpu":
        return (
            "--overlap-moe-expert-parallel-comm runs megatron-core's combined 1F1B schedule "
            "on a CUDA communication stream and events (pipeline_parallel/utils.py "
            "set_streams) and only in bf16 / fp16, which the CPU kernel set cannot run: "
            "predict it with the GPU kernel set (--device fake)"
        )
    if not ddp.defer_embedding_wgrad_compute:
        return ""
    if kernel_set == "cpu":
        return (
            "--defer-embedding-wgrad-compute needs gradient-accumulation fusion, a CUDA "
            "extension the CPU kernel set does not have (megatron-core refuses the setting "
            "without it): predict it with the GPU kernel set (--device fake)"
        )
    if not accumulation_fusion:
        return (
            "--defer-embedding-wgrad-compute needs gradient-accumulation fusion (megatron-core "
            "refuses it with --no-gradient-accumulation-fusion)"
        )
    return ""


def fsdp_problem(ddp: DdpOptions, kernel_set: str, fp8_param_gather: bool) -> str:
    """Why Megatron-FSDP is not modelled with these settings on `kernel_set` ('' when it is, or
    when it is off): it runs on CUDA only (its buffers, streams and NCCL device meshes), so the
    CPU kernel set does not describe it; FP8 parameters under it are not modelled."""
    if not ddp.fsdp.enabled:
        return ""
    if kernel_set == "cpu":
        return (
            "--use-megatron-fsdp: Megatron-FSDP runs on CUDA only (its buffers, CUDA streams and "
            "NCCL device meshes), which the CPU kernel set does not describe; predict it with the "
            "GPU kernel set (--device fake-cuda, the default without a GPU, or --device cuda)"
        )
    problems = fsdp_problems(ddp.fsdp, False, False, 1, False)
    if fp8_param_gather:
        problems.insert(0, (
            "--use-megatron-fsdp with --fp8-param-gather: Megatron-FSDP's FP8 weight buffers "
            "(uint8, their transpose caches) are not modelled yet; leave out --fp8-param-gather"
        ))  # fmt: skip
    return "; ".join(problems)


def kernels_offload_problem(ddp: OffloadSettings, kernels: Kernels) -> str:
    """Megatron-LM's rule for --optimizer-cpu-offload with FP8 parameters ('' when it runs)."""
    recipe = kernels.fp8_recipe
    if not (ddp.optimizer_cpu_offload and kernels.fp8_param_gather) or recipe == "delayed":
        return ""
    return (
        f"--optimizer-cpu-offload with --fp8-param-gather and --fp8-recipe {recipe}: "
        "Megatron-LM core_v0.16.1 megatron/training/arguments.py:1195-1198 stops ('When "
        "`--fp8-param-gather` is enabled, the optimizer cpu offload must be used in conjunction "
        "with `--fp8-recipe delayed`')"
    )
