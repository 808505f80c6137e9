"""What the CPU kernel set cannot train, refused before any process group starts (by
`capture-megatron train` before torchrun, and by each rank). Pure Python."""

from __future__ import annotations

from capture_megatron.config import TrainConfig
from capture_megatron.errors import CaptureError
from capture_megatron.rules.modelled import ddp_kernel_problem


def refuse_cpu_state(cfg: TrainConfig) -> None:
    """CaptureError for the gradient / optimizer-state settings the CPU kernel set cannot train:
    a deferred output-layer weight gradient (no gradient-accumulation fusion), and checkpoints of
    the precision-aware optimizer (megatron-core's distributed optimizer saves its state through
    torch's per-parameter Adam step counters without TE, which TE's FusedAdam, and so
    capture_megatron.emulate.host_adam, does not keep); and --adam-impl fused (a CPU run trains
    with torch.optim.AdamW)."""
    ddp = cfg.plan.ddp
    problem = ddp_kernel_problem(ddp, "cpu", False)
    if not problem and cfg.kernels.adam_impl == "fused":
        problem = (
            "--adam-impl fused: a CPU run trains with torch.optim.AdamW (Transformer Engine's and "
            "apex's FusedAdam need CUDA); leave --adam-impl out"
        )
    if (
        not problem
        and ddp.use_precision_aware_optimizer
        and (cfg.checkpoint.save or cfg.checkpoint.load)
    ):
        problem = (
            "--use-precision-aware-optimizer with --save / --load on CPU: megatron-core saves "
            "the distributed optimizer's state through the per-parameter step counters of "
            "torch's Adam when Transformer Engine is absent, which TE's FusedAdam (run here as "
            "its host re-implementation) does not keep; train it without checkpoints"
        )
    if problem:
        raise CaptureError(problem + ".")


def refuse_untrained(cfg: TrainConfig) -> None:
    """CaptureError for what capture-megatron's trainer does not run on any device: CUDA graphs
    (predict and plan model them; the trainer builds no CudaGraphManager or TE graph helper)."""
    graphs = cfg.plan.ddp.cuda_graphs
    if graphs.enabled:
        raise CaptureError(
            f"--cuda-graph-impl {graphs.impl}: capture-megatron's trainer does not capture CUDA "
            "graphs (predict and plan forecast them); train without the CUDA graph flags."
        )
