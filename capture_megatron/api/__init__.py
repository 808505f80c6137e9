"""The public Python API: predict() and plan(), from a Megatron-LM command line or typed objects,
returning a PlanResult (`to_json()`, `write(path)`). The command line and the benchmarks call
these; `capture_megatron.predict` and `capture_megatron.plan` are the same functions.

    import capture_megatron as cm
    result = cm.plan(["--num-layers", "32", "--hidden-size", "4096", ...], gpus=64,
                     gpu_memory_gib=80)
    result.best.plan.layout, result.best.rank_peaks, result.megatron_args()

A Request is the typed configuration (a ModelShape, a Cluster, PlanOptions and where the memory
model comes from); read_request builds it from a parsed command line.
"""

from capture_megatron.api.request import Request, read_request
from capture_megatron.api.run import forecast, plan, predict
from capture_megatron.planner.result import PlanResult

__all__ = ["PlanResult", "Request", "forecast", "plan", "predict", "read_request"]
