"""Check: the search's memory floor (plan/ranktimes.memory_floor) never exceeds the forecast.

The throughput search drops a candidate without profiling it when its floor of bytes plus margins
exceeds the GPU; a floor above the forecast would drop a plan that fits. For a model whose profile
cache holds (variant, size) pairs, every candidate of the default space on --gpus GPUs whose pairs
are cached is split by the exact min-max memory partition (full recompute: every layer
recomputed, its lightest form) and its worst rank's forecast compared with the floor.

    python bench/floor_check.py --hf-config tests/data/hf_configs/X.json --gpus 8 [--cache DIR]
    python bench/floor_check.py --preset gpt3-175b --gpus 1024

Prints each checked candidate's floor / forecast and exits 1 when a floor exceeds its forecast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from capture_megatron.cache import records_path
from capture_megatron.config import GIB, Cluster, Kernels, ParallelPlan, Recompute
from capture_megatron.config.hf import from_hf_config
from capture_megatron.config.kernels import kernel_set
from capture_megatron.config.presets import preset
from capture_megatron.fit import fit
from capture_megatron.planner.balance import balanced, evaluate_plan
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.ranktimes import memory_floor
from capture_megatron.planner.routing import routed
from capture_megatron.planner.run import DEFAULT_GLOBAL_BATCH
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.supply import pairs_of
from capture_megatron.records import read_records
from capture_megatron.steptime.model import CostModel


def lightest(plan: ParallelPlan) -> ParallelPlan:
    """The plan with every layer recomputed when it recomputes in full (its least memory)."""
    if plan.recompute.granularity != "full":
        return plan
    return dataclasses.replace(plan, recompute=Recompute("full", "uniform", (1,) * plan.pp))


def main() -> int:
    """Check every cached candidate; 1 when a floor exceeds its forecast."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-config", default="")
    ap.add_argument("--preset", default="")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH)
    a = ap.parse_args()
    shape = from_hf_config(a.hf_config) if a.hf_config else preset(a.preset)
    path = records_path(shape, "fake-cuda", kernel_set("fake-cuda", Kernels()))
    shape = routed(shape, "planning")
    records = read_records(path)
    have = {(r.variant, r.shape) for r in records}
    model = fit(records)
    cluster = Cluster(gpus=a.gpus, gpu_memory_bytes=80 * 2**30, device="cuda")
    worst, checked = 0.0, 0
    for plan in candidates(shape, cluster, a.global_batch_size, Space()):
        plan = lightest(plan)
        if not all(p in have for p in pairs_of(shape, plan)):
            continue
        split = balanced(model, shape, plan, keep_recompute=True)
        peak = evaluate_plan(model, shape, split, cluster, Margins(), CostModel()).peak
        floor = memory_floor(shape, plan)
        checked += 1
        worst = max(worst, floor / peak)
        flag = "  FLOOR ABOVE FORECAST" if floor > peak else ""
        print(
            f"tp{plan.tp} pp{plan.pp} dp{plan.dp} cp{plan.cp} ep{plan.ep} vpp{plan.vpp} "
            f"mbs{plan.micro_batch_size} {plan.recompute.granularity}: floor "
            f"{floor / GIB:.1f} / forecast {peak / GIB:.1f} GiB{flag}"
        )
    print(f"{checked} candidates checked; largest floor / forecast {worst:.3f}")
    return 1 if worst > 1 else 0


if __name__ == "__main__":
    sys.exit(main())
