"""PlanResult: what planning returns (ranked plans, the chosen plan's per-rank breakdown, baselines)
and the plan JSON it writes -- the contract of docs/ARCHITECTURE.md -- and reads back
(`launch --plan-json`). Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from capture_megatron.config import Cluster, Kernels, ModelShape, ParallelPlan, Recompute
from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.kernels import VALIDATION
from capture_megatron.config.layout import parse_layout
from capture_megatron.errors import CaptureError
from capture_megatron.forecast import StageMemory
from capture_megatron.planner.baselines import BASES, Baseline
from capture_megatron.planner.emit import flag_notes, model_args, run_args
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.routing import RoutingReport
from capture_megatron.planner.search import Evaluated
from capture_megatron.serial import from_plain, load_json, to_plain
from capture_megatron.steptime.model import CostModel, StepTime, step_time
from capture_megatron.version import __version__

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
    reasoning: tuple[str, ...] = ()
    """Why the plan was chosen and what the simpler setups need, one sentence each."""
    stock_alternative: Evaluated | None = None
    """When the plan's flags need capture-megatron's per-stage recompute: the best plan stock
    Megatron-LM runs (None when the plan's own flags are stock)."""
    margins: Margins = Margins()
    """The margins `needed` adds to a peak (allocator reserve, CUDA context)."""
    routing: RoutingReport | None = None
    """Dropless MoE: the routing factors and the chosen plan's peaks at each (None otherwise)."""
    cost: CostModel = CostModel()
    """The step-time model the plans were ranked with (hardware, overlap settings, constants)."""
    recompute_modules: tuple[str, ...] = ()
    """--recompute-modules as given, handed back with every plan (megatron-core reads them for
    selective recompute only)."""
    read_back: str = ""
    """The cache file this answer was read back from (capture_megatron.api.kept: the same request
    answered before from the same records by the same code); '' when it was worked out now."""

    @property
    def best(self) -> Evaluated:
        """The chosen plan with its prediction."""
        return self.ranked[0]

    def baseline(self, name: str) -> Baseline:
        """One baseline by name (memory-balanced, uniform, megatron-first-last,
        deepspeed-parameters)."""
        return next(b for b in self.baselines if b.name == name)

    @property
    def on_gpu(self) -> bool:
        """Whether the plan is for GPUs (the cost model's step times apply), not CPU processes."""
        return self.cluster.device != "cpu"

    def megatron_args(self, e: Evaluated | None = None) -> list[str]:
        """The Megatron flags of the chosen plan (or of `e`): parallel settings and kernels."""
        settings = self.cost.settings if self.on_gpu else None
        plan = (e or self.best).plan
        return run_args(plan, self.kernels, self._gpu_kernels, settings, self.recompute_modules)

    def flag_notes(self) -> tuple[str, ...]:
        """What the chosen plan's megatron_args need beyond stock Megatron-LM (empty: nothing)."""
        return flag_notes(self.best.plan, self.kernels, self._gpu_kernels)

    @property
    def step(self) -> StepTime:
        """The chosen plan's estimated step, broken down (throughput, MFU)."""
        return step_time(self.shape, self.best.plan, self.cost)

    def _step_entries(self) -> dict[str, Any]:
        """The estimated step's JSON keys (null for CPU processes: the model describes GPUs)."""
        if not self.on_gpu:
            keys = ("estimated_tokens_per_s_per_gpu", "estimated_model_tflops_per_gpu")
            return {
                **dict.fromkeys(keys),
                "estimated_mfu": None,
                "hardware": None,
                "step_time": None,
            }
        st = self.step
        return {
            "estimated_tokens_per_s_per_gpu": st.tokens_per_s_per_gpu,
            "estimated_model_tflops_per_gpu": st.tflops_per_gpu,
            "estimated_mfu": st.mfu,
            "hardware": to_plain(self.cost.hardware),
            "step_time": {
                "seconds": st.seconds,
                "pipeline_seconds": st.pipeline,
                "bubble_seconds": st.bubble,
                "p2p_seconds": st.p2p,
                "data_parallel_seconds": st.data_parallel,
                "optimizer_seconds": st.optimizer,
                "model_flops": st.model_flops,
                "settings": to_plain(self.cost.settings),
                "constants": to_plain(self.cost.constants),
            },
        }

    @property
    def megatron_core(self) -> str:
        """The megatron-core version the forecast was made for: the memory model's (the
        version its probes ran on; the version-dependent rules follow it too)."""
        return self.origin.versions[2]

    @property
    def _gpu_kernels(self) -> bool:
        return self.origin.kernels != "cpu"

    def to_plain(self) -> dict[str, Any]:
        """The plan JSON as plain data (docs/ARCHITECTURE.md's contract)."""
        best = self.best
        return {
            "capture_megatron_plan": PLAN_FORMAT,
            "version": __version__,
            "megatron_core": self.megatron_core,
            "plan": _plan_section(best.plan),
            "predicted_peak_bytes": list(best.rank_peaks),
            "breakdown": _breakdown(best.stages),
            "megatron_args": self.megatron_args(),
            "megatron_args_notes": list(self.flag_notes()),
            "stock_alternative": self._stock_entry(),
            "model_args": model_args(self.shape),
            "model": to_plain(self.shape),
            "baselines": {b.name: self._baseline_entry(b) for b in self.baselines},
            "needed_bytes_per_gpu": int(best.needed),
            "gpu_memory_bytes": self.cluster.gpu_memory_bytes,
            "fits": best.fits if self.cluster.gpu_memory_bytes else None,
            "kernels": to_plain(self.kernels),
            "ignored_flags": list(self.ignored_flags),
            "notes": list(self.notes),
            "reasoning": list(self.reasoning),
            "estimated_step_seconds": best.step_seconds if self.on_gpu else None,
            "moe_routing": self.routing.to_plain() if self.routing else None,
            **self._step_entries(),
            "memory_model": to_plain(self.origin),
            "validation": VALIDATION.get(self.origin.device, "not validated"),
        }

    def _stock_entry(self) -> dict[str, Any] | None:
        e = self.stock_alternative
        if e is None:
            return None
        return {
            "plan": _plan_section(e.plan),
            "megatron_args": self.megatron_args(e),
            "predicted_peak_bytes": list(e.rank_peaks),
            "needed_bytes_per_gpu": int(e.needed),
            "fits": e.fits,
            "estimated_step_seconds": e.step_seconds if self.on_gpu else None,
        }

    def comparison(self, b: Baseline) -> str:
        """How the plan compares with a baseline, in words (never a negative '% lower')."""
        if b.partition is None:
            return f"unavailable: {b.reason}"
        best, peak = self.best, b.partition.peak
        if peak > best.peak:
            words = f"the plan's worst rank is {100 * (1 - best.peak / peak):.1f}% lower"
        elif peak < best.peak:
            words = f"its worst rank is {100 * (1 - peak / best.peak):.1f}% below the plan's"
        else:
            words = "the same worst-rank peak as the plan"
        if self.cluster.gpu_memory_bytes and best.fits and not b.fits:
            words += "; it does not fit where the plan does"
        if b.recompute != best.plan.recompute and self.on_gpu:
            words += (
                f"; estimated step {b.step_seconds:.2f} s vs the plan's {best.step_seconds:.2f} s"
            )
        return words

    def _baseline_entry(self, b: Baseline) -> dict[str, Any]:
        if b.partition is None:
            return {"unavailable": b.reason}
        lower = 1 - self.best.peak / b.partition.peak
        entry: dict[str, Any] = {
            "layers_per_stage": list(b.partition.layers_per_stage),
            "recompute": to_plain(b.recompute),
            "recompute_basis": BASES[b.basis],
            "predicted_peak_bytes": [int(x) for x in b.partition.rank_peaks],
            "needed_bytes_per_gpu": int(b.needed),
            "fits": b.fits if self.cluster.gpu_memory_bytes else None,
            "estimated_step_seconds": b.step_seconds if self.on_gpu else None,
            "reduction_by_plan": lower if lower >= 0 else None,
            "comparison": self.comparison(b),
        }
        if b.flags:
            entry["megatron_args"] = list(b.flags)
        return entry

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
        "ep": p.ep,
        "etp": p.expert_tp,
        "cp_comm_type": p.cp_comm_type,
        "vpp": p.vpp,
        "micro_batch_size": p.micro_batch_size,
        "global_batch_size": p.global_batch_size,
        "layers_per_stage": list(p.layers_per_stage),
        "layout": p.layout,
        "recompute": to_plain(p.recompute),
        "sequence_parallel": p.sequence_parallel,
        "distributed_optimizer": p.distributed_optimizer,
        "ddp": to_plain(p.ddp),
    }


def _breakdown(stages: tuple[StageMemory, ...]) -> list[dict[str, Any]]:
    return [
        {
            "pp_rank": s.pp_rank,
            **{k: int(getattr(s, k)) for k in PARTS},
            "phase": s.phase,
            **({"host": int(s.host)} if s.host else {}),  # --optimizer-cpu-offload
            **({"activation_host": int(s.activation_host)} if s.activation_host else {}),
        }
        for s in stages
    ]


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
        section["ddp"] = from_plain(DdpOptions, section.get("ddp", {}))
        section["layers_per_stage"] = tuple(section["layers_per_stage"])
        if section.get("etp") == section.get("tp"):
            section["etp"] = 0  # expert TP equal to TP is megatron's default: no flag
        shape = from_plain(ModelShape, data["model"])
        plan = ParallelPlan(**section, mtp_layers=shape.mtp_num_layers)
    except (KeyError, TypeError, ValueError) as err:
        raise CaptureError(
            f"--plan-json {path}: its plan is incomplete or invalid ({type(err).__name__}: "
            f"{str(err)[:120]}); write it again with `capture-megatron plan --json`"
        ) from None
    if parse_layout(layout, plan.pp, shape.num_layers, plan.mtp_layers) != plan.layers_per_stage:
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
