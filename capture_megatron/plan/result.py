"""PlanResult: what planning returns (ranked plans, the chosen plan's per-rank breakdown, baselines)
and the plan JSON it writes -- the contract of docs/ARCHITECTURE.md -- and reads back
(`launch --plan-json`). Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from capture_megatron import __version__
from capture_megatron.config import Cluster, Kernels, ModelShape, ParallelPlan, Recompute
from capture_megatron.config.kernels import VALIDATION
from capture_megatron.config.layout import parse_layout
from capture_megatron.errors import CaptureError
from capture_megatron.plan.baselines import Baseline
from capture_megatron.plan.emit import kernel_args, model_args, plan_args
from capture_megatron.plan.search import Evaluated
from capture_megatron.predict import StageMemory
from capture_megatron.serial import from_plain, load_json, to_plain

PARTS = ("params", "grads", "optimizer", "activations", "transient", "other")
"""The parts of a rank's peak in the breakdown, bottom to top."""
PLAN_FORMAT = 1
"""Version of the plan JSON layout (its `capture_megatron_plan` key)."""


@dataclass(frozen=True)
class ModelOrigin:
    """Where the memory model behind a plan came from."""

    device: str
    """Where it was profiled: cpu, fake-cpu, fake-cuda or cuda."""
    kernels: str
    """The kernel set it describes: 'cpu' or 'gpu:' + the GPU kernels' key."""
    versions: tuple[str, str, str]
    """(capture-megatron, torch, megatron-core) of the probes."""


@dataclass(frozen=True)
class PlanResult:
    """The outcome of planning: the plans considered, best first, with the best one's baselines."""

    shape: ModelShape
    """The model planned."""
    cluster: Cluster
    """The machines planned for."""
    ranked: tuple[Evaluated, ...]
    """The top plans (fitting ones first, then by the objective); ranked[0] is the chosen one."""
    considered: int
    """Candidate plans evaluated."""
    baselines: tuple[Baseline, ...]
    """Other systems' splits at the chosen plan's sizes and recompute."""
    origin: ModelOrigin
    """The memory model's device, implementation and versions."""
    kernels: Kernels = Kernels()
    """The layer implementation and fused kernels of the run."""
    ignored_flags: tuple[str, ...] = ()
    """Megatron-LM flags given that cannot change memory (accepted and ignored)."""
    notes: tuple[str, ...] = ()
    """Assumptions the result rests on (e.g. a vocabulary assumed for a file not readable here)."""

    @property
    def best(self) -> Evaluated:
        """The chosen plan with its prediction."""
        return self.ranked[0]

    def baseline(self, name: str) -> Baseline:
        """One baseline by name (uniform, megatron-first-last, deepspeed-parameters)."""
        return next(b for b in self.baselines if b.name == name)

    def to_plain(self) -> dict[str, Any]:
        """The plan JSON as plain data (docs/ARCHITECTURE.md's contract)."""
        best = self.best
        return {
            "capture_megatron_plan": PLAN_FORMAT,
            "version": __version__,
            "plan": _plan_section(best.plan),
            "predicted_peak_bytes": list(best.rank_peaks),
            "breakdown": _breakdown(best.stages),
            "megatron_args": plan_args(best.plan) + kernel_args(self.kernels),
            "model_args": model_args(self.shape),
            "model": to_plain(self.shape),
            "baselines": {b.name: _baseline_entry(b, best.peak) for b in self.baselines},
            "needed_bytes_per_gpu": int(best.needed),
            "gpu_memory_bytes": self.cluster.gpu_memory_bytes,
            "fits": best.fits if self.cluster.gpu_memory_bytes else None,
            "kernels": to_plain(self.kernels),
            "ignored_flags": list(self.ignored_flags),
            "notes": list(self.notes),
            "estimated_step_seconds": best.step_seconds,
            "memory_model": to_plain(self.origin),
            "validation": VALIDATION.get(self.origin.device, "not validated"),
        }

    def to_json(self) -> str:
        """The plan JSON text."""
        return json.dumps(self.to_plain(), indent=1)

    def write(self, path: str) -> None:
        """Write the plan JSON to `path`."""
        with open(path, "w") as f:
            f.write(self.to_json())


def _plan_section(p: ParallelPlan) -> dict[str, Any]:
    return {
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "cp": p.cp,
        "vpp": p.vpp,
        "micro_batch_size": p.micro_batch_size,
        "global_batch_size": p.global_batch_size,
        "layers_per_stage": list(p.layers_per_stage),
        "layout": p.layout,
        "recompute": to_plain(p.recompute),
        "sequence_parallel": p.sequence_parallel,
        "distributed_optimizer": p.distributed_optimizer,
    }


def _breakdown(stages: tuple[StageMemory, ...]) -> list[dict[str, Any]]:
    return [
        {"pp_rank": s.pp_rank, **{k: int(getattr(s, k)) for k in PARTS}, "phase": s.phase}
        for s in stages
    ]


def _baseline_entry(b: Baseline, best_peak: float) -> dict[str, Any]:
    if b.partition is None:
        return {"unavailable": b.reason}
    entry: dict[str, Any] = {
        "layers_per_stage": list(b.partition.layers_per_stage),
        "predicted_peak_bytes": [int(x) for x in b.partition.rank_peaks],
        "reduction_by_plan": 1 - best_peak / b.partition.peak,
    }
    if b.flags:
        entry["megatron_args"] = list(b.flags)
    return entry


@dataclass(frozen=True)
class PlanFile:
    """What a plan JSON fixes for a run: the model and its parallel plan."""

    shape: ModelShape
    """The model planned."""
    plan: ParallelPlan
    """The chosen plan (sizes, layout, recompute, batch)."""


def read_plan(path: str) -> PlanFile:
    """The model and plan of a plan JSON written by this version (one-paragraph CaptureError for a
    missing or unreadable file, JSON that is not a plan, or a plan of another version)."""
    data = _load(path)
    try:
        section = dict(data["plan"])
        layout = section.pop("layout")
        section["recompute"] = from_plain(Recompute, section["recompute"])
        section["layers_per_stage"] = tuple(section["layers_per_stage"])
        plan = ParallelPlan(**section)
        shape = from_plain(ModelShape, data["model"])
    except (KeyError, TypeError, ValueError) as err:
        raise CaptureError(
            f"--plan-json {path}: its plan is incomplete or invalid ({type(err).__name__}: "
            f"{str(err)[:120]}); write it again with `capture-megatron plan --json`"
        ) from None
    if parse_layout(layout, plan.pp, shape.num_layers) != plan.layers_per_stage:
        raise CaptureError(
            f"--plan-json {path}: layout {layout!r} does not match layers_per_stage "
            f"{list(plan.layers_per_stage)}"
        )
    return PlanFile(shape, plan)


def _load(path: str) -> dict[str, Any]:
    data = load_json(path, f"--plan-json {path}")
    if not isinstance(data, dict) or data.get("capture_megatron_plan") != PLAN_FORMAT:
        raise CaptureError(
            f"--plan-json {path} is not a plan written by `capture-megatron plan --json` (format "
            f"{PLAN_FORMAT}); write one with `capture-megatron plan ... --json {path}`"
        )
    if data.get("version") != __version__:
        raise CaptureError(
            f"--plan-json {path} was written by capture-megatron {data.get('version')}; this is "
            f"{__version__}: plan again with this version"
        )
    return data
