"""What a GPU must hold beyond a plan's predicted peak of allocated bytes: the caching allocator's
reserve and the memory outside the allocator, each a separate term with its measured source
(docs/MEMORY_MODEL.md, Margins). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import GIB, ModelShape, ParallelPlan
from capture_megatron.features.dispatch import deepep_buffer_bytes, hybridep_buffer_bytes

RESERVE_FRACTION = 0.02
"""Default allocator reserve: reserved was 1.9% above allocated on a dense Megatron-LM run on H100
(docs/MEMORY_MODEL.md, Margins), rounded up. MoE runs show 13-26% (Megatron's offloading docs);
MoE is not modelled."""
CONTEXT_GIB = 3.9
"""Default memory per process outside the allocator (CUDA context, NCCL), GiB: the upper bound
measured on the same run (docs/MEMORY_MODEL.md, Margins; taken during a checkpoint save)."""


@dataclass(frozen=True)
class Margins:
    """What a GPU must hold beyond a plan's predicted peak of allocated bytes."""

    reserve_fraction: float = RESERVE_FRACTION
    """CUDA: the caching allocator's reserve above allocated, as a fraction of the peak."""
    context_bytes: float = CONTEXT_GIB * GIB
    """CUDA: the CUDA context and NCCL, outside the allocator."""
    calibration: float = 1.0
    """Measured / predicted peak of verified runs on this device (`verify --refit`)."""
    on_cpu: bool = False
    """CPU processes: no allocator reserve and no CUDA context."""
    userbuffers_per_token: int = 0
    """CUDA with --tp-comm-overlap: bytes per token of Transformer Engine's userbuffers, outside
    the allocator (capture_megatron.config.Kernels.userbuffer_bytes_per_token); 0 without."""

    hybridep_domain: int = 0
    """CUDA with the flex dispatcher's HybridEP backend: the GPUs per NVLink domain HybridEP's
    buffers span (features.dispatch.hybridep_buffer_bytes), outside the allocator; 0
    without HybridEP."""

    deepep_sms: int = 0
    """CUDA with the flex dispatcher's DeepEP backend: the SMs of its kernels
    (--moe-deepep-num-sms), which size its buffers (features.dispatch.deepep_buffer_bytes),
    outside the allocator; 0 without DeepEP."""

    def hybridep_bytes(self, shape: ModelShape, plan: ParallelPlan) -> int:
        """HybridEP's buffers on each GPU of `plan`, outside the allocator (0 without HybridEP):
        megatron-core sizes them by the tokens of a layer's input on a rank (sequence x
        micro-batch / TP x CP, sequence parallelism being on with TP > 1 in MoE models)."""
        if not self.hybridep_domain or self.on_cpu or not shape.moe.enabled:
            return 0
        return hybridep_buffer_bytes(
            shape.hidden_size,
            shape.seq_length * plan.micro_batch_size // (plan.tp * plan.cp),
            plan.ep * plan.expert_tp,
            shape.moe.num_experts // plan.ep,
            self.hybridep_domain,
        )

    def deepep_bytes(self, shape: ModelShape, plan: ParallelPlan) -> int:
        """DeepEP's buffers on each GPU of `plan`, outside the allocator (0 without DeepEP):
        megatron-core sizes them by the expert TP x EP group and the hidden size only."""
        if not self.deepep_sms or self.on_cpu or not shape.moe.enabled:
            return 0
        return deepep_buffer_bytes(shape.hidden_size, plan.ep * plan.expert_tp, self.deepep_sms)

    def plan_needed(self, peak: float, shape: ModelShape, plan: ParallelPlan) -> float:
        """Bytes a GPU must have for a predicted peak of `plan` (userbuffers and the flex
        dispatcher's buffers sized by the plan)."""
        outside = self.hybridep_bytes(shape, plan) + self.deepep_bytes(shape, plan)
        return self.needed(peak, userbuffer_tokens(shape, plan)) + outside

    def flex_note(self, shape: ModelShape, plan: ParallelPlan) -> str:
        """What `need` counts of HybridEP's or DeepEP's buffers for `plan` ('' without them)."""
        hybrid = self.hybridep_bytes(shape, plan)
        nbytes = hybrid or self.deepep_bytes(shape, plan)
        if not nbytes:
            return ""
        size = f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"
        name = "HybridEP" if hybrid else "DeepEP"
        sized = (
            "sized as DeepEP's hybrid-ep eb9cee7 allocates them for the expert TP x EP group over "
            "NVLink domains of the --gpu-type's size"
            if hybrid
            else "its NVLink and RDMA buffers and workspace, sized as megatron-core's get_buffer "
            "asks DeepEP eb9cee7 for the expert TP x EP group"
        )
        note = (
            f"need includes {name}'s communication buffers, {size} per GPU outside the "
            f"allocator (flex dispatcher, --moe-flex-dispatcher-backend {name.lower()}; {sized}, "
            "docs/MEMORY_MODEL.md)"
        )
        if shape.moe.moe_router_dtype != "fp32":
            note += (
                f"; {name} takes float32 routing probabilities only: megatron-core converts "
                "them (warning 'please set --moe-router-dtype=fp32' at every dispatch), and the "
                "forecast holds the float32 copies"
            )
        return note

    def needed(self, peak: float, tokens: int = 0) -> float:
        """Bytes a GPU must have for a predicted peak (`tokens`: the plan's sequence x
        micro-batch / CP, which sizes the userbuffers)."""
        peak = peak * self.calibration
        if self.on_cpu:
            return peak
        outside = self.context_bytes + self.userbuffers_per_token * tokens
        return peak * (1 + self.reserve_fraction) + outside


def userbuffer_tokens(shape: ModelShape, plan: ParallelPlan) -> int:
    """Rows of TE's userbuffers for a plan: sequence x micro-batch / CP (Megatron-LM's
    _initialize_tp_communicators)."""
    return shape.seq_length * plan.micro_batch_size // plan.cp
