"""The step-time model: a Megatron step's structure with constants fitted to NVIDIA's measured H100
runs (docs/STEP_TIME.md). Pure Python, fast: the planner's search calls it for every candidate.

    from capture_megatron.steptime import CostModel, step_time
    step = step_time(shape, plan, CostModel())   # StepTime: seconds, bubble, exposed comms, MFU

hardware holds the GPU profiles (--gpu-type and its overrides), settings the run's overlap
settings, kernels the primitives (a GEMM, an HBM pass, a ring collective; LayerTime and its
Parts), attention the attention block (standard or MLA), moe an MoE layer's expert block (router,
permutes, dispatch and combine, grouped GEMMs, shared experts, EP overlap), parts a layer's time
(TP / CP communication, recompute, offloading, host launches) and the last stage's (output layer,
MTP), fsdp Megatron-FSDP's collectives, launch host launches and CUDA graphs, flops the model
FLOPs, model the step (pipeline, data-parallel reduce, optimizer), breakdown where a step's time
goes and plans side by side, constants the fitted constants (constants.json, written by
bench/step_time.py), offload what optimizer offloading costs per step.
"""

from capture_megatron.steptime.breakdown import StepBreakdown, breakdown, side_by_side
from capture_megatron.steptime.constants import Constants, fitted
from capture_megatron.steptime.hardware import Hardware, HardwareFlags, gpu_profile
from capture_megatron.steptime.model import (
    ChunkTime,
    CostModel,
    StepTime,
    model_flops,
    step_seconds,
    step_time,
)
from capture_megatron.steptime.settings import StepSettings

__all__ = [
    "ChunkTime",
    "Constants",
    "CostModel",
    "Hardware",
    "HardwareFlags",
    "StepBreakdown",
    "StepSettings",
    "StepTime",
    "breakdown",
    "fitted",
    "gpu_profile",
    "model_flops",
    "side_by_side",
    "step_seconds",
    "step_time",
]
