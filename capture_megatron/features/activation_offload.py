"""Fine-grained activation offloading (ActivationOffload): Megatron-LM core_v0.16.1's
`--fine-grained-activation-offloading`, `--offload-modules` and `--min-offloaded-tensor-size`,
with megatron-core's rules (TransformerConfig.__post_init__). Pure Python: no torch import here.

megatron-core 0.16.1 (pipeline_parallel/fine_grained_activation_offload.py) copies to pinned
host memory the tensors each named module group saves for the backward, those of at least the
threshold's elements that are not parameters; the forecast is docs/MEMORY_MODEL.md's
"Fine-grained activation offloading" (capture_megatron.forecast.offload).
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.errors import require
from capture_megatron.fields import flag
from capture_megatron.serial import JsonMixin

OFFLOAD_MODULES = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "expert_fc1",
    "moe_act",
)
"""The module groups megatron-core 0.16.1 can offload (TransformerConfig.__post_init__), in the
order a transformer layer's forward opens them."""

OFFLOAD_SETS = (
    ("core_attn", "attn_proj"),
    ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"),
    OFFLOAD_MODULES,
)
"""The --offload-modules sets the planner searches, each holding the one before: the attention
core's inputs and output; every group of a dense layer (its norms' and QKV projection's inputs
too); and for MoE layers the routed experts' too (expert_fc1, moe_act)."""


@dataclass(frozen=True)
class ActivationOffload(JsonMixin):
    """Megatron-LM's fine-grained activation offloading settings (read only when it is on)."""

    fine_grained_activation_offloading: bool = flag("--fine-grained-activation-offloading", False)
    """Offload what the --offload-modules groups save for the backward to pinned host memory
    (needs --transformer-impl transformer_engine; the GPU kernel set only)."""
    offload_modules: tuple[str, ...] = flag(
        "--offload-modules", (), note=f"(megatron-core 0.16.1: {', '.join(OFFLOAD_MODULES)})"
    )
    """The module groups offloaded (read only with --fine-grained-activation-offloading)."""
    min_offloaded_tensor_size: int = flag("--min-offloaded-tensor-size", 1024 * 1024)
    """Saved tensors of fewer elements stay on the GPU (read only with
    --fine-grained-activation-offloading)."""

    def __post_init__(self) -> None:
        require(self.problems(), "fine-grained activation offloading")

    @classmethod
    def of(cls, modules: tuple[str, ...]) -> ActivationOffload:
        """Offloading of these module groups at megatron-core's threshold (none when empty)."""
        return cls(bool(modules), modules)

    def problems(self) -> list[str]:
        """What megatron-core's TransformerConfig refuses in these settings (only when on)."""
        if not self.fine_grained_activation_offloading:
            return []
        p = []
        if not self.offload_modules:
            p.append("TransformerConfig asserts --offload-modules names at least one module")
        unknown = sorted(set(self.offload_modules) - set(OFFLOAD_MODULES))
        if unknown:
            p.append(
                f"'Invalid choices for offload_modules: {unknown}' (allowed: "
                + ", ".join(OFFLOAD_MODULES)
                + ")"
            )
        if "attn_proj" in self.offload_modules and "core_attn" not in self.offload_modules:
            p.append(
                "'attn_proj cannot be set to offload_modules alone without core_attn' (its "
                "input is core_attn's output, which core_attn's backward needs)"
            )
        if self.min_offloaded_tensor_size < 0:
            p.append(f"--min-offloaded-tensor-size {self.min_offloaded_tensor_size} is negative")
        return p

    @property
    def groups(self) -> tuple[str, ...]:
        """The module groups offloaded (none when off)."""
        return self.offload_modules if self.fine_grained_activation_offloading else ()


@dataclass(frozen=True)
class OffloadTensor(JsonMixin):
    """One storage a transformer layer's forward saves for the backward inside a fine-grained
    offloading group (capture_megatron.profile.offload), as megatron-core 0.16.1 would see it."""

    group: str
    """The module group whose context saved it first (config.act_offload.OFFLOAD_MODULES)."""
    numel: int
    """Elements of the saved tensor (megatron-core offloads it when at least
    --min-offloaded-tensor-size)."""
    nbytes: int
    """Bytes of its storage, freed on the device when it is offloaded."""

    def __post_init__(self) -> None:
        require(
            [] if self.numel >= 0 and self.nbytes >= 0 else [f"negative size {self}"],
            "offloaded tensor",
        )
