"""What the output says of a plan beyond its reasoning: what optimizer offloading saves on the
device and costs per step (pure Python)."""

from __future__ import annotations

from capture_megatron.planner.result import PlanResult
from capture_megatron.steptime.model import step_time
from capture_megatron.steptime.offload import offload_note as offload_words
from capture_megatron.steptime.offload import state_saved, without_offload

CHOSEN_OFFLOAD = (
    "the planner offloads the optimizer (--optimizer-cpu-offload, searched where it fits the "
    "model on fewer GPUs or beats recompute and more stages; --optimizer-offload-fraction 0 keeps "
    "it off): --use-precision-aware-optimizer, which Megatron-LM needs for it, is on at its "
    "default fp32 dtypes and changes no bytes, as HybridDeviceOptimizer takes none of its dtypes "
    "(megatron-core 0.16.1 optimizer/__init__.py, param_update_in_fp32=True)"
)
"""What plan says when it chose --optimizer-cpu-offload itself."""


def offload_note(result: PlanResult, given: bool = True) -> str:
    """With --optimizer-cpu-offload: what it saves on the device and costs per step, on the rank
    with the most host bytes ('' without offload); `given` False: the planner turned it on, and
    says with which flags."""
    plan = result.best.plan
    if not plan.ddp.optimizer_cpu_offload:
        return ""
    stage = max(result.best.stages, key=lambda s: s.host)
    saved = state_saved(result.shape.dtype, plan, stage.optimizer, stage.host)
    seconds = None
    if result.on_gpu:
        before = step_time(result.shape, without_offload(plan), result.cost).seconds
        seconds = step_time(result.shape, plan, result.cost).seconds - before
    chosen = "" if given else f"{CHOSEN_OFFLOAD}; "
    return chosen + offload_words(plan, stage.host, saved, seconds)
