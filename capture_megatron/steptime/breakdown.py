"""Where a step's time goes, and two or more plans side by side (what the planner and the CLI print
when a plan claims much more throughput than NVIDIA's published configuration for the same model
and GPUs). Pure Python.

A step is m x the slowest pipeline rank's micro-batch plus the fill and drain (the bubble), the
pipeline sends left exposed, the data-parallel collectives left exposed and the optimizer step
(capture_megatron.steptime.model). The breakdown splits the m x slowest-rank part by what each
layer's seconds are (capture_megatron.steptime.kernels.Parts: compute, exposed TP / CP / EP
communication, MoE dispatch work, recompute, offload transfers, overhead) and keeps the rest as
the step has it, so the parts add up to the step's seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from capture_megatron.serial import JsonMixin
from capture_megatron.steptime.kernels import Parts
from capture_megatron.steptime.model import StepTime

OUTPACES = 0.15
"""A plan whose throughput exceeds a published configuration's (for the same model and GPUs) by
more than this fraction is shown beside it, part by part."""
LABELS = {
    "compute": "compute (GEMMs, attention, memory-bound kernels)",
    "tp": "exposed TP communication",
    "cp": "exposed CP communication",
    "ep": "exposed EP communication (MoE dispatch / combine)",
    "dispatch": "MoE dispatch work (router, permute)",
    "dp": "exposed DP communication",
    "recompute": "recompute",
    "offload": "activation offload transfers",
    "overhead": "schedule and launch overhead",
    "bubble": "pipeline bubble",
    "p2p": "exposed pipeline sends",
    "optimizer": "optimizer step",
}
"""Each part's name as printed, in the order printed."""


@dataclass(frozen=True)
class StepBreakdown(JsonMixin):
    """One optimizer step's seconds by where they go (they add up to `seconds`)."""

    seconds: float
    """The step."""
    compute: float
    """GEMMs, the attention core and memory-bound kernels of the slowest rank's micro-batches."""
    tp: float
    """Its tensor-parallel (and expert tensor-parallel) collectives left exposed."""
    cp: float
    """Its context-parallel K/V exchange left exposed."""
    ep: float
    """Its MoE dispatch and combine communication left exposed."""
    dispatch: float
    """Its MoE router and permute / unpermute passes."""
    dp: float
    """Data-parallel collectives left exposed: the step's gradient reduce and parameter gather,
    and Megatron-FSDP's per-layer ones."""
    recompute: float
    """Forward work re-run in the backward."""
    offload: float
    """Activation offloading's transfers compute does not hide."""
    overhead: float
    """Schedule overhead per pass and host launches kernels do not hide."""
    bubble: float
    """The pipeline's fill and drain."""
    p2p: float
    """Pipeline sends left exposed."""
    optimizer: float
    """The optimizer step."""

    def rows(self) -> list[tuple[str, float]]:
        """(name, seconds) of every part, in LABELS' order."""
        return [(name, getattr(self, name)) for name in LABELS]

    def as_dict(self) -> dict[str, float]:
        """The parts and the step by name."""
        return asdict(self)


def breakdown(step: StepTime) -> StepBreakdown:
    """The breakdown of an estimated step (module docstring)."""
    ranks = sorted({c.pp_rank for c in step.chunks})
    per_rank = {r: sum((c.parts for c in step.chunks if c.pp_rank == r), Parts()) for r in ranks}
    totals = {r: sum(c.forward + c.backward for c in step.chunks if c.pp_rank == r) for r in ranks}
    slowest = max(ranks, key=lambda r: totals[r])
    m = (step.pipeline - step.bubble) / totals[slowest] if totals[slowest] else 0.0
    steady = per_rank[slowest].scaled(m)
    return StepBreakdown(
        seconds=step.seconds,
        compute=steady.compute,
        tp=steady.tp,
        cp=steady.cp,
        ep=steady.ep,
        dispatch=steady.dispatch,
        dp=steady.dp + step.data_parallel,
        recompute=steady.recompute,
        offload=steady.offload,
        overhead=steady.overhead,
        bubble=step.bubble,
        p2p=step.p2p,
        optimizer=step.optimizer,
    )


def outpaces(ours: StepTime, published: StepTime, margin: float = OUTPACES) -> bool:
    """Whether `ours` claims more than `margin` more tokens per second per GPU than `published`
    (the same model and GPUs): the case where the output shows both, side by side."""
    return ours.tokens_per_s_per_gpu > (1 + margin) * published.tokens_per_s_per_gpu


def side_by_side(columns: Sequence[tuple[str, StepBreakdown]]) -> list[str]:
    """A plain-text table of the plans' steps part by part: seconds and share of each plan's step,
    and, for two plans, the second minus the first; parts zero in every plan left out."""
    if not columns:
        return []
    names = [n for n, _ in columns]
    two = len(columns) == 2
    head = f"{'part':<52}" + "".join(f"{n:>22}" for n in names)
    head += f"{'difference':>14}" if two else ""
    out = [head, "-" * len(head)]
    for key, label in LABELS.items():
        values = [getattr(b, key) for _, b in columns]
        if not any(values):
            continue
        line = f"{label:<52}" + "".join(
            f"{v:>12.3f} s {v / b.seconds if b.seconds else 0.0:>6.1%}"
            for v, (_, b) in zip(values, columns)
        )
        line += f"{values[1] - values[0]:>+12.3f} s" if two else ""
        out.append(line)
    total = f"{'step':<52}" + "".join(f"{b.seconds:>12.3f} s {1:>6.0%}" for _, b in columns)
    total += f"{columns[1][1].seconds - columns[0][1].seconds:>+12.3f} s" if two else ""
    return [*out, total]
