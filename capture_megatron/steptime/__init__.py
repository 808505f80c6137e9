"""The step-time model: a Megatron step's structure with constants fitted to NVIDIA's measured H100
runs (docs/STEP_TIME.md). Pure Python, fast: the planner's search calls it for every candidate.

    from capture_megatron.steptime import CostModel, step_time
    step = step_time(shape, plan, CostModel())   # StepTime: seconds, bubble, exposed comms, MFU

hardware holds the GPU profiles (--gpu-type and its overrides), settings the run's overlap
settings, parts the pieces of a layer's time (GEMMs, attention, memory-bound kernels, TP / CP / EP
communication, recompute), model the step (pipeline, data-parallel reduce, optimizer), constants
the fitted constants (constants.json, written by bench/step_time.py), offload what optimizer
offloading costs per step.
"""

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
    "StepSettings",
    "StepTime",
    "fitted",
    "gpu_profile",
    "model_flops",
    "step_seconds",
    "step_time",
]
