"""capture-megatron: profile, predict and balance per-GPU peak memory of Megatron-Core training.

The Python API (capture_megatron.api): `predict(flags_or_request, ...)` forecasts every pipeline
rank's peak of the run a Megatron-LM command line describes; `plan(flags_or_request, ...)` finds the
fastest plan that fits (or the lowest peak, or the fewest GPUs). Both return a PlanResult
(`to_json()`). Importing this package loads neither torch nor the planner; the first use of an API
name does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from capture_megatron.version import __version__

if TYPE_CHECKING:
    from capture_megatron.api import PlanResult, Request, plan, predict

__all__ = ["PlanResult", "Request", "__version__", "plan", "predict"]

_API = frozenset({"PlanResult", "Request", "plan", "predict"})


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (capture_megatron.api)."""
    if name in _API:
        from capture_megatron import api

        return getattr(api, name)
    raise AttributeError(f"module 'capture_megatron' has no attribute {name!r}")
