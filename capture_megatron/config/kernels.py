"""Kernels: which implementation and fused kernels a run uses, each field with its Megatron-LM flag
and default (core_v0.16.1). What a transformer layer keeps for backward depends on them: flash or
cuDNN-fused attention keep no s x s tensor, the unfused paths do; fused softmax keeps one 16-bit
output; CUDA dropout keeps 1-byte masks. Pure Python.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from capture_megatron.errors import CaptureError, require
from capture_megatron.features.fp8 import FP8_FORMATS, FP8_RECIPES, key_parts
from capture_megatron.features.tp_overlap import userbuffer_bytes_per_token
from capture_megatron.fields import flag
from capture_megatron.serial import JsonMixin

IMPLEMENTATIONS = ("local", "transformer_engine", "auto")
"""--transformer-impl: Megatron-LM's choices, and auto (capture-megatron training: TE when
importable on CUDA, else the local spec)."""
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
"""--attention-backend choices; auto lets Transformer Engine pick (flash, else cuDNN fused)."""

ADAM_IMPLS = ("auto", "fused", "torch")
"""--adam-impl choices (capture-megatron): which Adam megatron-core trains with on a GPU."""
FOREACH_ADAM_BYTES = 4
"""Bytes per updated element that torch's AdamW holds at its step's peak on a GPU (its foreach
implementation, torch's default for CUDA parameters: `exp_avg_sq_sqrt =
torch._foreach_sqrt(exp_avg_sqs)`, one fp32 temporary for every parameter of the group it steps,
torch/optim/adam.py _multi_tensor_adam). Measured on the H100: a one-layer probe's step peak is
4 bytes x its weight-decay group's elements (bench/results/gpu/h100-run-b)."""

TE_FUSED_BACKENDS = ("flash", "fused", "auto")
"""Transformer Engine attention backends that keep no s x s tensor (flash-attn or cuDNN): a sliding
window changes no memory under them, and they run context parallelism (TE's ring attention)."""


@dataclass(frozen=True)
class Kernels(JsonMixin):
    """The layer implementation and the fused kernels of a run."""

    transformer_impl: str = flag(
        "--transformer-impl", "transformer_engine", choices=IMPLEMENTATIONS
    )
    """Megatron's local spec or Transformer Engine's modules."""
    attention_backend: str = flag("--attention-backend", "auto", choices=ATTENTION_BACKENDS)
    """Transformer Engine's attention backend (the local spec has its own unfused attention)."""
    attention_softmax_in_fp32: bool = flag("--attention-softmax-in-fp32", False)
    """Compute the unfused attention softmax in fp32."""
    apply_query_key_layer_scaling: bool = flag("--apply-query-key-layer-scaling", False)
    """Scale Q K^T by the layer number (implies the softmax in fp32)."""
    masked_softmax_fusion: bool = flag("--no-masked-softmax-fusion", True, negate=True)
    """The fused scale-mask-softmax kernel (local spec, unfused attention)."""
    bias_gelu_fusion: bool = flag("--no-bias-gelu-fusion", True, negate=True)
    """The fused bias + GeLU."""
    bias_swiglu_fusion: bool = flag("--no-bias-swiglu-fusion", True, negate=True)
    """The fused bias + SwiGLU."""
    bias_dropout_fusion: bool = flag("--no-bias-dropout-fusion", True, negate=True)
    """The fused bias + dropout + residual add."""
    rope_fusion: bool = flag("--no-rope-fusion", True, negate=True)
    """The fused rotary position embedding."""
    cross_entropy_loss_fusion: bool = flag("--cross-entropy-loss-fusion", False)
    """The fused vocabulary-parallel cross entropy."""
    cross_entropy_fusion_impl: str = flag(
        "--cross-entropy-fusion-impl", "native", choices=("native", "te")
    )
    """Which fused cross entropy: Megatron's native one or Transformer Engine's."""
    gradient_accumulation_fusion: bool = flag(
        "--no-gradient-accumulation-fusion", True, negate=True
    )
    """Weight gradients accumulated straight into the fp32 main gradients (needs TE or apex)."""
    deterministic_mode: bool = flag("--deterministic-mode", False)
    """Deterministic kernels (flash-attn's backward then keeps one dq accumulator per SM split)."""
    create_attention_mask_in_dataloader: bool = flag(
        "--no-create-attention-mask-in-dataloader", True, negate=True
    )
    """Megatron's GPT dataset builds a bool [b, 1, s, s] attention mask per micro-batch, which the
    first and last stages receive and pass to the layers."""
    cublas_workspace_config: str = flag(
        "--cublas-workspace-config",
        "",
        note="(capture-megatron: the run's $CUBLAS_WORKSPACE_CONFIG, e.g. :4096:8; default: "
        "torch's on Hopper, 32 MiB)",
    )
    """The training run's CUBLAS_WORKSPACE_CONFIG (sizes torch's cuBLAS workspaces)."""
    fp8_format: str = flag("--fp8-format", "", choices=FP8_FORMATS)
    """FP8 training with Transformer Engine: e4m3 everywhere, or hybrid (e4m3 forward, e5m2
    gradients); empty: no FP8. The GPU kernel set only (capture_megatron.features.fp8)."""
    fp8_recipe: str = flag("--fp8-recipe", "delayed", choices=FP8_RECIPES)
    """How FP8 tensors are scaled: per tensor from an amax history (delayed) or the current amax
    (tensorwise), per 32-element block (mxfp8) or per 128-element / 128 x 128 block (blockwise)."""
    fp8_param_gather: bool = flag("--fp8-param-gather", False)
    """Keep the linear layers' weights in FP8 (fp32 master copies in the distributed optimizer)
    and all-gather them in FP8."""
    fp8_amax_history_len: int = flag("--fp8-amax-history-len", 1)
    """Amax values kept per FP8 tensor (delayed scaling)."""
    first_last_layers_bf16: bool = flag("--first-last-layers-bf16", False)
    """With FP8, run the first and last layers in bf16 (refused with FP8: not modelled)."""
    moe_permute_fusion: bool = flag("--moe-permute-fusion", False)
    """Transformer Engine's fused MoE token permutation (the GPU kernel set)."""
    moe_router_fusion: bool = flag("--moe-router-fusion", False)
    """Transformer Engine's fused MoE top-k routing and aux-loss kernels (the GPU kernel set)."""
    tp_comm_overlap: bool = flag("--tp-comm-overlap", False)
    """Overlap the tensor-parallel all-gathers and reduce-scatters with the GEMMs through
    Transformer Engine's userbuffers (needs sequence parallelism, hence TP > 1)."""
    tp_comm_overlap_cfg: str = flag("--tp-comm-overlap-cfg", "")
    """A YAML file of userbuffer settings per layer (refused: only TE's defaults are modelled)."""
    adam_impl: str = flag("--adam-impl", "auto", choices=ADAM_IMPLS, note="(capture-megatron)")
    """Which Adam megatron-core trains with on the GPU: fused (Transformer Engine's or apex's
    FusedAdam, which it imports when either is installed: Megatron-LM's runs), torch
    (torch.optim.AdamW, its fallback without both, whose step holds an fp32 temporary per updated
    element) or auto (fused for a forecast; on a GPU, whichever is installed)."""

    def __post_init__(self) -> None:
        p = self._fp8_problems()
        if self.transformer_impl not in IMPLEMENTATIONS:
            p.append(f"--transformer-impl {self.transformer_impl!r} not one of {IMPLEMENTATIONS}")
        if self.adam_impl not in ADAM_IMPLS:
            p.append(f"--adam-impl {self.adam_impl!r} not one of {ADAM_IMPLS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            p.append(
                f"--attention-backend {self.attention_backend!r} not one of {ATTENTION_BACKENDS}"
            )
        require(p, "kernel settings")

    def _fp8_problems(self) -> list[str]:
        """FP8 settings Megatron-LM refuses or the model does not cover."""
        p = []
        if self.fp8_format not in FP8_FORMATS:
            p.append(f"--fp8-format {self.fp8_format!r} not one of {FP8_FORMATS[1:]}")
        if self.fp8_recipe not in FP8_RECIPES:
            p.append(f"--fp8-recipe {self.fp8_recipe!r} not one of {FP8_RECIPES}")
        if self.fp8_amax_history_len < 1:
            p.append(f"--fp8-amax-history-len {self.fp8_amax_history_len} must be >= 1")
        return p

    @property
    def fp8(self) -> bool:
        """Whether the run trains in FP8 (--fp8-format given)."""
        return bool(self.fp8_format)

    @property
    def low_precision(self) -> bool:
        """Whether the linear layers' GEMMs compute in a 1-byte format (FP8), so that what they
        keep of their inputs, and what TE all-gathers for them, is quantized (the features' view
        of the precision: capture_megatron.features.fp8 has what each recipe keeps)."""
        return self.fp8

    @property
    def low_precision_params(self) -> bool:
        """Whether the linear layers' weights are 1-byte parameters in DDP's buffers (FP8 with
        --fp8-param-gather)."""
        return self.fp8 and self.fp8_param_gather

    @property
    def gemm_input_bytes(self) -> int:
        """Bytes per element of the linear layers' GEMM inputs as TE communicates them: 1 in a
        1-byte format, else 2 (bf16 / fp16)."""
        return 1 if self.low_precision else 2

    def workspace_bytes(self) -> int:
        """GPU memory every training process allocates once and keeps, which no probe sees:
        torch's cuBLAS workspace for each (handle, stream) pair — the forward runs on the main
        thread's handle, the backward on autograd's device thread's, hence two; sized by
        CUBLAS_WORKSPACE_CONFIG as the sum of SIZE KiB x COUNT, default 4096 x 8 on sm90
        (pytorch aten/src/ATen/cuda/CublasHandlePool.cpp: parseChosenWorkspaceSize,
        getNewWorkspace allocates through the caching allocator) — and, with Transformer Engine,
        TE's one cuBLAS workspace of 32 MiB + 1 KiB on sm90 (transformer_engine/pytorch/
        cpp_extensions/gemm.py get_cublas_workspace, a torch.empty)."""
        cublas = cublas_workspace_size(self.cublas_workspace_config)
        te = TE_WORKSPACE if self.for_gpu().transformer_impl == "transformer_engine" else 0
        return CUBLAS_HANDLES * cublas + te

    @property
    def softmax_in_fp32(self) -> bool:
        """Whether the unfused softmax runs in fp32 (Megatron: either flag implies it)."""
        return self.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling

    def for_gpu(self) -> Kernels:
        """These kernels as a GPU run resolves them: `auto` implementation means Transformer
        Engine (Megatron-LM's default; capture-megatron's own training picks it when TE imports)."""
        if self.transformer_impl == "auto":
            return dataclasses.replace(self, transformer_impl="transformer_engine")
        return self

    def key(self) -> str:
        """A short, canonical name of the settings that change what layers keep, e.g.
        'transformer_engine/unfused/softmax-fp32' (defaults are not named)."""
        parts = [self.transformer_impl, self.attention_backend]
        if self.softmax_in_fp32:
            parts.append("softmax-fp32")
        for name in NEGATED:
            if not getattr(self, name):
                parts.append("no-" + name.replace("_", "-"))
        if self.cross_entropy_loss_fusion:
            parts.append("ce-fusion-" + self.cross_entropy_fusion_impl)
        if self.cublas_workspace_config:
            parts.append("cublas" + self.cublas_workspace_config)
        if self.fp8:
            parts += key_parts(self.fp8_recipe, self.fp8_param_gather, self.fp8_amax_history_len)
        if self.tp_comm_overlap:
            parts.append("tp-comm-overlap")
        if self.adam_impl == "torch":
            parts.append("torch-adam")
        parts += [n for n, on in (("moe-permute", self.moe_permute_fusion),
                                  ("moe-router", self.moe_router_fusion)) if on]  # fmt: skip
        return "/".join(parts)

    def userbuffer_bytes_per_token(self, hidden_size: int) -> int:
        """Bytes per token (row of the [seq x micro-batch / CP, hidden] shape) of the
        userbuffers --tp-comm-overlap allocates on every GPU, outside the caching allocator
        (capture_megatron.features.tp_overlap.userbuffer_bytes_per_token); 0 without it."""
        if not self.tp_comm_overlap:
            return 0
        return userbuffer_bytes_per_token(hidden_size, self.gemm_input_bytes)


NEGATED = (
    "masked_softmax_fusion",
    "bias_gelu_fusion",
    "bias_swiglu_fusion",
    "bias_dropout_fusion",
    "rope_fusion",
    "gradient_accumulation_fusion",
)
"""Fusions on by default in Megatron-LM (named in Kernels.key() when turned off)."""
CUBLAS_HANDLES = 2
"""cuBLAS handles a training process uses (main thread: forward; autograd's device thread:
backward); torch keeps one workspace per (handle, stream)."""
CUBLAS_DEFAULT = ":4096:8"
"""torch's default CUBLAS_WORKSPACE_CONFIG on sm90 (Hopper), 32 MiB."""
TE_WORKSPACE = 32 * 1024 * 1024 + 1024
"""Transformer Engine's cuBLAS workspace on sm90 (get_cublas_workspace_size_bytes)."""
CPU_KERNELS = "cpu"
"""The kernel set of CPU runs: the local spec with torch's CPU kernels, no fused kernels."""


def cublas_workspace_size(config: str) -> int:
    """Bytes of one torch cuBLAS workspace for a CUBLAS_WORKSPACE_CONFIG value (':SIZE:COUNT'
    pairs, SIZE in KiB; '' is torch's sm90 default); CaptureError for an unparsable value."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or CUBLAS_DEFAULT)
    if not pairs:
        raise CaptureError(
            f"--cublas-workspace-config {config!r}: expected :SIZE:COUNT pairs (SIZE in KiB), "
            "e.g. :4096:8"
        )
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def kernel_set(device: str, kernels: Kernels) -> str:
    """The name of the kernel set a memory model of `device` describes: 'cpu' for the CPU devices
    (what CPU training allocates), else 'gpu:' + the GPU kernels' key."""
    if device in ("cpu", "fake-cpu"):
        return CPU_KERNELS
    return "gpu:" + kernels.for_gpu().key()


VALIDATION = {
    "cpu": "CPU kernels, measured exactly; checked against CPU training runs under torchrun "
    "(tests/dist: every rank within 2%)",
    "fake-cpu": "CPU kernels on fake tensors; equal to CPU measurements (tests/unit)",
    "fake-cuda": "GPU kernel set (Transformer Engine / fused CUDA kernels emulated, "
    "docs/MEMORY_MODEL.md) on a fake CUDA device; checked against Megatron-LM's own "
    "functional tests measured on 8 x H100 (docs/BENCHMARKS.md, conformance)",
    "cuda": "measured on a real GPU; checked against single-GPU training runs on an H100 with "
    "Megatron's local spec (docs/BENCHMARKS.md, On a real GPU: every run within 1.4%)",
}
"""How a memory model profiled on each device was validated (named in every plan's output)."""
