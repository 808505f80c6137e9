"""Dropless MoE routing in a plan: peaks at the forecast, fits at the forecast plus its margin,
and the worst-case bound beside them (pure Python).

capture_megatron.forecast.routing gives three factors per (model, plan): the forecast (the expected
imbalance, from measured routing statistics), the planning factor (the forecast plus the measured
spread: its 95th percentile) and the worst case (experts / top-k). Plans are searched, balanced and
judged fitting at the planning factor; every peak shown is then the forecast of the same plan, and
the chosen plan's bound is predicted beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan
from capture_megatron.fit import MemoryModel, ModelSource
from capture_megatron.forecast.routing import RoutingFactor, routing_factor
from capture_megatron.planner.baselines import Baseline
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.partition import Partition
from capture_megatron.planner.search import Evaluated, evaluate_plan
from capture_megatron.planner.supply import Supply
from capture_megatron.steptime.model import CostModel


def routed(shape: ModelShape, case: str) -> ModelShape:
    """`shape` with its dropless routing predicted at `case` (forecast, planning or bound);
    unchanged without dropless experts."""
    if not shape.moe.dropless or shape.moe.routing_case == case:
        return shape
    return dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, routing_case=case))


@dataclass(frozen=True)
class RoutingReport:
    """The chosen plan's dropless routing: its factors and per-rank peaks at each."""

    factors: RoutingFactor
    """Forecast, planning and worst-case factors, and their source."""
    forecast_peaks: tuple[int, ...]
    """Per pipeline rank, the peak at the forecast (the plan's predicted_peak_bytes)."""
    planning_peaks: tuple[int, ...]
    """Per pipeline rank, the peak at the planning factor (what `fits` is judged on)."""
    bound_peaks: tuple[int, ...]
    """Per pipeline rank, the peak at the worst case."""
    bound_needed: float
    """What the worst rank needs at the worst case, with the allocator/context margin."""
    bound_fits: bool
    """bound_needed <= the GPU's memory."""

    def to_plain(self) -> dict[str, Any]:
        """The plan JSON's `moe_routing` section."""
        f = self.factors
        return {
            "forecast_factor": f.forecast,
            "planning_factor": f.planning,
            "bound_factor": f.bound,
            "basis": f.basis,
            "source": f.source,
            "forecast_peak_bytes": list(self.forecast_peaks),
            "planning_peak_bytes": list(self.planning_peaks),
            "bound_peak_bytes": list(self.bound_peaks),
            "bound_needed_bytes_per_gpu": int(self.bound_needed),
            "bound_fits": self.bound_fits,
        }

    def notes(self) -> tuple[str, ...]:
        """What the forecast assumes, with the bound beside it, in words."""
        f = self.factors
        worst = f"{max(self.bound_peaks) / GIB:.2f} GiB"
        head = (
            f"MoE routing is dropless: the forecast assumes the busiest expert-parallel rank "
            f"receives {f.forecast:g} x its balanced share of tokens ({f.source})"
        )
        if f.planning > f.forecast:
            head += (
                f"; fits are judged at {f.planning:g} x, the forecast plus the measured spread "
                f"(its 95th percentile): {max(self.planning_peaks) / GIB:.2f} GiB"
            )
        bound = (
            f"MoE routing worst case (every token of an expert's ranks routed to it, "
            f"{f.bound:g} x): {worst} on the worst rank"
            + ("" if self.bound_fits else ", which would not fit")
            + f"; --moe-imbalance-factor {f.bound:g} forecasts it"
        )
        return head, bound


def _model(
    memory: MemoryModel | ModelSource, shape: ModelShape, plans: list[ParallelPlan]
) -> MemoryModel:
    return Supply(shape, memory).complete(plans)


def at_forecast(
    memory: MemoryModel | ModelSource,
    shape: ModelShape,
    ranked: tuple[Evaluated, ...],
    cluster: Cluster,
    margins: Margins,
    hw: CostModel,
) -> tuple[Evaluated, ...]:
    """Each plan (evaluated at the planning factor) with its peaks at the forecast; what it needs
    and whether it fits stay those of the planning factor."""
    fore = routed(shape, "forecast")
    if fore == shape or not ranked:
        return ranked
    model = _model(memory, fore, [e.plan for e in ranked])
    out = []
    for e in ranked:
        f = evaluate_plan(model, fore, e.plan, cluster, margins, hw)
        out.append(dataclasses.replace(f, needed=e.needed, fits=e.fits, bound=e.bound))
    return tuple(out)


def baselines_at_forecast(
    memory: MemoryModel | ModelSource,
    shape: ModelShape,
    plan: ParallelPlan,
    baselines: tuple[Baseline, ...],
    cluster: Cluster,
    margins: Margins,
    hw: CostModel,
) -> tuple[Baseline, ...]:
    """The chosen plan's baselines (split and recompute chosen at the planning factor) with their
    peaks at the forecast; what each needs and whether it fits stay those of the planning factor,
    as the plans' (at_forecast)."""
    fore = routed(shape, "forecast")
    if fore == shape:
        return baselines
    splits = {
        b.name: dataclasses.replace(
            plan, layers_per_stage=b.partition.layers_per_stage, recompute=b.recompute
        )
        for b in baselines
        if b.partition is not None
    }
    model = _model(memory, fore, list(splits.values()))
    out = []
    for b in baselines:
        if b.partition is not None:
            f = evaluate_plan(model, fore, splits[b.name], cluster, margins, hw)
            peaks = tuple(s.peak for s in f.stages)
            b = dataclasses.replace(
                b, partition=Partition(b.partition.layers_per_stage, f.peak, peaks)
            )
        out.append(b)
    return tuple(out)


def routing_report(
    memory: MemoryModel | ModelSource,
    shape: ModelShape,
    planned: Evaluated,
    forecast: Evaluated,
    cluster: Cluster,
    margins: Margins,
    hw: CostModel,
) -> RoutingReport | None:
    """The chosen plan's routing report (None without dropless experts): `planned` is its
    evaluation at the planning factor, `forecast` at the forecast."""
    if not shape.moe.dropless:
        return None
    plan: ParallelPlan = planned.plan
    bound_shape = routed(shape, "bound")
    bound = evaluate_plan(
        _model(memory, bound_shape, [plan]), bound_shape, plan, cluster, margins, hw
    )
    return RoutingReport(
        routing_factor(shape, plan),
        forecast.rank_peaks,
        planned.rank_peaks,
        bound.rank_peaks,
        bound.needed,
        bound.needed <= cluster.gpu_memory_bytes,
    )
