"""Plan: the exact memory-balanced partition and the parallel sizes for a cluster. Pure Python (no
torch; the memory model comes in ready, or from a ModelSource such as
capture_megatron.profile.memory_source).

    from capture_megatron.planner import PlanOptions, plan
    result = plan(shape, cluster, PlanOptions(objective="throughput"), memory_source("fake"))
    result.best.plan.layout            # Megatron's --pipeline-model-parallel-layout
    result.write("plan.json")          # the plan JSON (docs/ARCHITECTURE.md)

partition splits layers over stages (exact min-max), search balances and ranks candidate sizes
by the step-time model (capture_megatron.steptime), baselines predicts other systems' splits, emit
writes Megatron flags (and model_notes what stock Megatron-LM cannot build), result holds the
PlanResult and its JSON, run ties them together.
"""

from capture_megatron.planner.baselines import Baseline
from capture_megatron.planner.emit import model_args, model_notes, plan_args
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.result import PlanFile, PlanResult, read_plan
from capture_megatron.planner.run import PlanOptions, plan
from capture_megatron.planner.search import OBJECTIVES, Evaluated
from capture_megatron.planner.space import Space, space_from

__all__ = [
    "OBJECTIVES",
    "Baseline",
    "Evaluated",
    "Margins",
    "PlanFile",
    "PlanOptions",
    "PlanResult",
    "Space",
    "model_args",
    "model_notes",
    "plan",
    "plan_args",
    "read_plan",
    "space_from",
]
