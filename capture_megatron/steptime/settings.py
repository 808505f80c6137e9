"""StepSettings: the run settings that change how long a training step takes but are not part of
the plan, as the step-time model reads them (overlap of communication, attention kernels).
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.serial import JsonMixin


@dataclass(frozen=True)
class StepSettings(JsonMixin):
    """What a Megatron run overlaps and which attention and gradient kernels it runs (Megatron-LM's
    defaults; the gradient precision is the plan's)."""

    tp_comm_overlap: bool = False
    """--tp-comm-overlap: TP all-gathers / reduce-scatters overlapped with the GEMMs
    (userbuffers)."""
    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce: the data-parallel gradient reduce overlaps the backward."""
    overlap_param_gather: bool = False
    """--overlap-param-gather: the distributed optimizer's parameter all-gather overlaps the next
    step's forward."""
    overlap_p2p_comm: bool = True
    """The interleaved schedule overlaps its pipeline sends with compute (Megatron-LM's default;
    off with --no-overlap-p2p-communication)."""
    fused_attention: bool = True
    """Transformer Engine's flash / cuDNN fused attention (False: an unfused attention that
    materialises the s x s scores)."""
    deterministic: bool = False
    """--deterministic-mode (deterministic attention backward)."""
    gradient_accumulation_fusion: bool = True
    """Weight gradients accumulated straight into the main gradients (off with
    --no-gradient-accumulation-fusion: each micro-batch writes them and adds them in)."""
    moe_permute_fusion: bool = False
    """--moe-permute-fusion: Transformer Engine's fused permute / unpermute (one pass over the
    routed tokens each; twice the traffic without)."""
    moe_shared_expert_overlap: bool = False
    """--moe-shared-expert-overlap: the shared experts' projections run beside the dispatch and
    the combine (capture_megatron.steptime.moe)."""
    delay_wgrad_compute: bool = False
    """--delay-wgrad-compute: with --overlap-moe-expert-parallel-comm the MLP's weight gradients
    run beside the dispatch's backward (capture_megatron.steptime.moe.exposed)."""
    cuda_graph_impl: str = "none"
    """--cuda-graph-impl: none, local or transformer_engine (capture_megatron.steptime.launch)."""
    cuda_graph_scope: tuple[str, ...] = ()
    """--cuda-graph-scope: attn, mlp, moe, moe_router, moe_preprocess, mamba or full_iteration;
    empty: the whole transformer layer (megatron-core 0.16.1's default)."""
