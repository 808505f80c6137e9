"""Plan: the exact memory-balanced partition and the parallel sizes for a cluster. Pure Python (no
torch; the memory model comes in ready, or from a ModelSource such as
capture_megatron.profile.memory_source).

    from capture_megatron.plan import PlanOptions, plan
    result = plan(shape, cluster, PlanOptions(objective="throughput"), memory_source("fake"))
    result.best.plan.layout            # Megatron's --pipeline-model-parallel-layout
    result.write("plan.json")          # the plan JSON (docs/ARCHITECTURE.md)

partition splits layers over stages (exact min-max), search balances and ranks candidate sizes,
costmodel estimates step time (costparts its pieces, calibration its fitted constants;
docs/STEP_TIME.md), baselines predicts other systems' splits, emit writes Megatron flags
(and model_notes what stock Megatron-LM cannot build), window says whether a sliding window is
modelled under the run's kernels, result holds the PlanResult and its JSON, planner ties them
together.
"""

from capture_megatron.plan.baselines import Baseline
from capture_megatron.plan.costmodel import CostModel, StepTime, step_seconds, step_time
from capture_megatron.plan.emit import model_args, model_notes, plan_args
from capture_megatron.plan.margins import Margins
from capture_megatron.plan.planner import PlanOptions, plan
from capture_megatron.plan.result import PlanFile, PlanResult, read_plan
from capture_megatron.plan.search import OBJECTIVES, Evaluated
from capture_megatron.plan.space import Space, space_from

__all__ = [
    "OBJECTIVES",
    "Baseline",
    "CostModel",
    "Evaluated",
    "Margins",
    "PlanFile",
    "PlanOptions",
    "PlanResult",
    "Space",
    "StepTime",
    "model_args",
    "model_notes",
    "plan",
    "plan_args",
    "read_plan",
    "space_from",
    "step_seconds",
    "step_time",
]
