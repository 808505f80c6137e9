"""Benchmark: the planner against NVIDIA's recipes (issue 28). For GPT-3 175B on 128 GPUs and
Llama 3.1 8B / 70B / 405B on 8 / 64 / 512 (dgxc-benchmarking, the settings their own configs used:
bench/step_time_rows.py), each with the recipe's global batch and sequence on H100 80 GB:

- the default plan (throughput objective, everything searched that the recipe does not fix as a
  training setting: its gradient precision), its estimated step and predicted peak;
- NVIDIA's configuration (sizes, layout, batch) predicted and estimated by the same models and
  the same run settings (overlap of the DP gradient reduce / parameter gather as the planner turns
  them on; TP communication overlap, which three recipes run, is left out of both: its
  userbuffers are modelled for a given --tp-comm-overlap, but the planner does not search it);
- whether NVIDIA's configuration is in the searched space and predicted to fit.

And the fixed-size comparison: Llama 3 70B, 64 GPUs, TP 4 PP 4 VPP 2 micro-batch 1, no
recompute, the throughput objective's layout against the min-peak objective's.

GPU kernel set (fake-CUDA profile, the planner's margins). Search time is the wall and CPU time of
plan() in this process, cold or warm as the cache was (the machine is shared: see the load).

    python bench/planner_recipes.py [--out bench/results/planner_recipes.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from step_time_rows import Row, rows

from capture_megatron.config import GIB, Cluster, Kernels, ParallelPlan
from capture_megatron.planner import PlanOptions, Space, plan
from capture_megatron.planner.run import searched_options
from capture_megatron.planner.space import candidates
from capture_megatron.profile import memory_source
from capture_megatron.steptime.hardware import Hardware
from capture_megatron.steptime.model import CostModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("gpt175-v2502-128", "l8b-v2504-8", "l70b-v2504-64", "l405b-v2504-512")
"""The recipes compared, each at the fewest GPUs NVIDIA published it for."""


def config(p: ParallelPlan) -> str:
    """A plan's sizes in NVIDIA's words."""
    rc = p.recompute
    recompute = "" if rc.granularity == "none" else f" recompute {rc.granularity}"
    if rc.granularity == "full":
        recompute += f" {list(rc.num_layers)}"
    ddp = p.ddp
    offload = f" optimizer offload {ddp.optimizer_offload_fraction:g}" * ddp.optimizer_cpu_offload
    groups = ddp.activation_offload.groups
    offload += f" activation offload {','.join(groups)}" if groups else ""
    return (
        f"TP{p.tp} PP{p.pp} VP{p.vpp} CP{p.cp} DP{p.dp} mbs{p.micro_batch_size}"
        f"{' SP' if p.sequence_parallel else ''}{' DO' if p.distributed_optimizer else ''}"
        f"{recompute}{offload}"
    )


def _sizes(p: ParallelPlan) -> tuple:
    return (p.tp, p.pp, p.vpp, p.cp, p.dp, p.micro_batch_size, p.sequence_parallel,
            p.distributed_optimizer, p.recompute.granularity)  # fmt: skip


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def compare(row: Row) -> dict:
    """The default plan beside NVIDIA's configuration of one recipe."""
    hw = Hardware()
    cluster = Cluster(gpus=row.plan.world_size, gpu_memory_bytes=hw.memory_bytes)
    settings = dataclasses.replace(row.settings, tp_comm_overlap=False)
    source = memory_source(row.shape, "fake", False, Kernels())
    options = PlanOptions(
        space=Space(ddp=row.plan.ddp),
        global_batch_size=row.plan.global_batch_size,
        cost=CostModel(hw, settings),
    )
    ours, wall, cpu = _timed(lambda: plan(row.shape, cluster, options, source))
    theirs = plan(row.shape, cluster, dataclasses.replace(options, fixed=row.plan), source).best
    space = searched_options(options, cluster, row.shape).space
    gbs = row.plan.global_batch_size
    in_space = any(
        _sizes(c) == _sizes(row.plan) for c in candidates(row.shape, cluster, gbs, space)
    )
    best = ours.best
    return {
        "id": row.id, "gpus": row.plan.world_size, "global_batch": gbs,
        "seq_length": row.shape.seq_length, "recipe": row.recipe,
        "plan": config(best.plan), "plan_layout": best.plan.layout,
        "plan_step_s": best.step_seconds, "plan_peak_bytes": best.peak,
        "plan_needed_bytes": best.needed, "plan_bound_s": best.bound,
        "plans_considered": ours.considered, "search_wall_s": wall, "search_cpu_s": cpu,
        "nvidia": config(row.plan), "nvidia_layout": row.plan.layout,
        "nvidia_step_s": theirs.step_seconds, "nvidia_peak_bytes": theirs.peak,
        "nvidia_needed_bytes": theirs.needed, "nvidia_fits": theirs.fits,
        "nvidia_in_space": in_space, "measured_s": row.measured,
    }  # fmt: skip


def fixed_sizes(row: Row) -> dict:
    """Llama 3 70B at TP 4 PP 4 VPP 2 micro-batch 1 without recompute: the throughput objective's
    layout against the min-peak objective's (the rest, SP and the distributed optimizer,
    searched)."""
    hw = Hardware()
    cluster = Cluster(gpus=64, gpu_memory_bytes=hw.memory_bytes)
    settings = dataclasses.replace(row.settings, tp_comm_overlap=False)
    space = Space(
        tp=(4,), pp=(4,), vpp=(2,), cp=(1,), micro_batch_size=(1,), recompute=("none",),
        ddp=row.plan.ddp,
    )  # fmt: skip
    source = memory_source(row.shape, "fake", False, Kernels())
    out = {}
    for objective in ("throughput", "min-peak"):
        options = PlanOptions(
            objective=objective, space=space, global_batch_size=row.plan.global_batch_size,
            cost=CostModel(hw, settings),
        )  # fmt: skip
        e = plan(row.shape, cluster, options, source).best
        out[objective] = {
            "plan": config(e.plan), "layout": e.plan.layout,
            "layers_per_rank": [e.plan.layers_of(r) for r in range(e.plan.pp)],
            "step_s": e.step_seconds, "peak_bytes": e.peak, "needed_bytes": e.needed,
            "rank_peaks": list(e.rank_peaks), "fits": e.fits,
        }  # fmt: skip
    out["gpus"], out["global_batch"] = 64, row.plan.global_batch_size
    out["gpu_memory_bytes"] = hw.memory_bytes
    return out


def main() -> None:
    """Compare every recipe; write the results after each one (`complete` false until the last:
    a run cut short keeps the rows it finished)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/planner_recipes.json"))
    ap.add_argument("--only", default="", help="one recipe id (a partial run, not written)")
    args = ap.parse_args()
    by_id = {r.id: r for r in rows()}
    load = [os.getloadavg()[1]]
    chosen = [args.only] if args.only else list(RECIPES)
    fixed = fixed_sizes(by_id["l70b-v2504-64"]) if not args.only else {}
    print(json.dumps(fixed), flush=True)
    results: list[dict] = []
    for key in chosen:
        results.append(compare(by_id[key]))
        print(json.dumps(results[-1]), flush=True)
        if not args.only:
            write(args.out, results, fixed, [*load, os.getloadavg()[1]], key == chosen[-1])


def write(path: str, results: list[dict], fixed: dict, load: list[float], complete: bool) -> None:
    """The results file (see main)."""
    about = (
        "The default plan (throughput objective) against NVIDIA's recipe configuration on H100 "
        f"({Hardware().memory_bytes / GIB:.2f} GiB), each estimated by the step-time model and "
        "predicted by the GPU kernel set's memory model with the same run settings (DP overlap "
        "on, TP communication overlap off for both). in_space: NVIDIA's sizes are a candidate "
        "of the searched space. load_average_5min: at the start and end (a shared machine)."
    )
    data = {"about": about, "recipes": results, "fixed_sizes": fixed, "load_average_5min": load}
    with open(path, "w") as f:
        json.dump({**data, "complete": complete}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
