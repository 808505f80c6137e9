"""NVIDIA's Llama 3.1 recipes (8B / 70B / 405B, context parallel 2; dgxc-benchmarking) predicted:
each recipe at the fewest GPUs it was published for (the most optimizer state per GPU), with the
model, plan and settings its own config used (bench/step_time_rows.py): the GPU kernel set's memory
forecast (fake-CUDA profile, the planner's margins) against 80 GiB, and the step-time estimate
against the measured step.

    python bench/llama_recipes.py [--out bench/results/llama_recipes.json]
"""

from __future__ import annotations

import argparse
import json
import os

from step_time_rows import rows

from capture_megatron.config import GIB, Cluster, Kernels
from capture_megatron.planner import PlanOptions, plan
from capture_megatron.profile import memory_source
from capture_megatron.steptime.model import CostModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b")
"""The recipes run with context parallelism 2."""


def main() -> None:
    """Predict each recipe; write the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/llama_recipes.json"))
    args = ap.parse_args()
    chosen: dict[str, object] = {}
    for row in rows():
        if row.model in FAMILIES and row.plan.cp == 2:
            key = row.id.rsplit("-", 1)[0]
            if key not in chosen or row.plan.world_size < chosen[key].plan.world_size:
                chosen[key] = row
    out = []
    for key, row in chosen.items():
        cluster = Cluster(gpus=row.plan.world_size, gpu_memory_bytes=80 * GIB)
        options = PlanOptions(fixed=row.plan, cost=CostModel(settings=row.settings))
        result = plan(
            row.shape, cluster, options, memory_source(row.shape, "fake", True, Kernels())
        )
        best, st, p = result.best, result.step, row.plan
        out.append(
            {
                "id": key, "gpus": p.world_size, "settings": row.recipe,
                "config": f"TP{p.tp} PP{p.pp} VP{p.vpp} CP{p.cp} DP{p.dp} mbs{p.micro_batch_size} "
                f"gbs{p.global_batch_size}{' SP' if p.sequence_parallel else ''}"
                f"{' DO' if p.distributed_optimizer else ''}"
                f"{' bf16-grads' if p.ddp.grad_reduce_in_bf16 else ''}",
                "peak_bytes": max(best.rank_peaks), "needed_bytes": best.needed, "fits": best.fits,
                "rank_peaks": list(best.rank_peaks),
                "estimated_s": st.seconds, "measured_s": row.measured,
                "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu, "mfu": st.mfu,
            }
        )  # fmt: skip
        print(out[-1])
    about = (
        "Each recipe at the fewest GPUs NVIDIA published it for, as its config ran it; peak: the "
        "GPU kernel set's forecast of the worst pipeline rank (fake-CUDA profile), need: with the "
        "planner's margins (allocator reserve and CUDA context, docs/MEMORY_MODEL.md); fits: need "
        "<= 80 GiB. Not in the forecast: the userbuffers of --tp-comm-overlap (70B, 405B). "
        "Estimated vs measured: the step-time model (docs/STEP_TIME.md)."
    )
    with open(args.out, "w") as f:
        json.dump({"about": about, "recipes": out}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
