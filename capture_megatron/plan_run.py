"""Run the plan command: obtain the memory model, search or predict, report (table, JSON, PNG)."""
from __future__ import annotations

import dataclasses

from capture_megatron import planner
from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import args as margs
from capture_megatron.plan_report import plan_json, print_table, save_png, write_json
from capture_megatron.predict import variant_of
from capture_megatron.profile.requests import anchor_shape


def default_device(requested: str) -> str:
    """cuda when usable, else fake (which reproduces the host's kernels exactly)."""
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "fake"


def gpu_counts(cluster: Cluster, limit: int) -> list[int]:
    """GPU counts min-gpus tries: 1..gpus_per_node, then whole nodes up to `limit`."""
    small = list(range(1, min(cluster.gpus_per_node, limit) + 1))
    return small + list(range(2 * cluster.gpus_per_node, limit + 1, cluster.gpus_per_node))


def memory_model(ns, shape: ModelShape, plans: list[ParallelPlan]):
    """The memory model from --memory-model, or profiled (cached) for the candidates' sizes."""
    if ns.memory_model:
        from capture_megatron.fit_cli import read_model
        return read_model(ns.memory_model)
    from capture_megatron.model_source import profiled_model

    needs = {(variant_of(shape, p), anchor_shape(shape, p.tp, p.micro_batch_size)) for p in plans}
    return profiled_model(shape, default_device(ns.device), needs, progress=not ns.no_progress)


def smallest_fit(model, shape, cluster, gbs, space, need, hw, limit: int):
    """(gpus, Evaluated) of the fewest GPUs up to `limit` on which some plan fits, else None."""
    for n in gpu_counts(cluster, limit):
        sub = dataclasses.replace(cluster, gpus=n)
        found = planner.search(model, shape, sub, gbs, space, "min-peak", need, hw, top=1)
        if found.ranked and found.ranked[0].fits:
            return n, found.ranked[0]
    return None


def _no_fit(model, shape, cluster, gbs, space, need, hw, best) -> CaptureError:
    if need(0.0) >= cluster.gpu_memory_bytes:
        return CaptureError(f"no plan fits {cluster.gpu_memory_bytes / GIB:g} GiB per GPU: the CUDA context and "
                            f"allocator margin alone take {need(0.0) / GIB:.1f} GiB (--context-gib)")
    found = smallest_fit(model, shape, cluster, gbs, space, need, hw, limit=max(64 * cluster.gpus, 64))
    if found:
        p = found[1].plan
        where = (f"the smallest fitting setup is {found[0]} GPUs at {found[1].needed / GIB:.1f} GiB (TP {p.tp}, PP "
                 f"{p.pp}, DP {p.dp}, VPP {p.vpp}, micro-batch {p.micro_batch_size}, recompute "
                 f"{p.recompute.granularity})")
    else:
        where = f"none fits on up to {max(64 * cluster.gpus, 64)} GPUs either"
    return CaptureError(f"no plan fits {cluster.gpu_memory_bytes / GIB:g} GiB on {cluster.gpus} GPUs (best needs "
                        f"{best.needed / GIB:.1f} GiB per GPU); {where}")


def run_plan(ns, shape: ModelShape, cluster: Cluster, space: planner.Space, hw) -> int:
    """Plan (or predict a given layout), print the table, write JSON / PNG; returns the exit code."""
    plan_outputs(ns, shape, cluster, space, hw)
    return 0


def plan_outputs(ns, shape: ModelShape, cluster: Cluster, space: planner.Space, hw=None, quiet: bool = False) -> dict:
    """Plan (or predict a given layout), print the table, write JSON / PNG; returns the plan JSON."""
    from capture_megatron.calibration import factor
    from capture_megatron.costmodel import Hardware

    hw = hw or Hardware(efficiency=ns.mfu)
    scale = factor(default_device(ns.device) if not ns.memory_model else "")
    need = lambda peak: planner.needed_bytes(peak * scale, cluster, ns.reserve_fraction, ns.context_gib * GIB)  # noqa: E731
    gbs = ns.global_batch_size or max(cluster.gpus, 1) * (ns.micro_batch_size or 1)
    if ns.pipeline_model_parallel_layout:
        plan = margs.parallel_plan(ns, shape, cluster.gpus)
        model = memory_model(ns, shape, [plan])
        ranked = [planner.evaluate_plan(model, shape, plan, cluster, need, hw)]
        considered = 1
    else:
        plans = list(planner.candidates(shape, cluster, gbs, space))
        if not plans:
            raise CaptureError(_why_no_candidate(shape, cluster, gbs, space))
        model = memory_model(ns, shape, plans)
        if ns.objective == "min-gpus":
            found = smallest_fit(model, shape, cluster, gbs, space, need, hw, cluster.gpus)
            if found is None:
                best = planner.search(model, shape, cluster, gbs, space, "min-peak", need, hw, top=1).ranked[0]
                raise _no_fit(model, shape, cluster, gbs, space, need, hw, best)
            ranked, considered = [found[1]], 1
        else:
            result = planner.search(model, shape, cluster, gbs, space, ns.objective, need, hw, top=ns.top)
            ranked, considered = list(result.ranked), result.considered
        if not ranked[0].fits:
            raise _no_fit(model, shape, cluster, gbs, space, need, hw, ranked[0])
    best = ranked[0]
    out = plan_json(model, shape, best, cluster)
    if not quiet:
        print_table(shape, cluster, ranked, considered, out)
    if ns.json:
        write_json(out, ns.json)
    if ns.png:
        save_png(out, ns.png)
    return out


def _why_no_candidate(shape: ModelShape, cluster: Cluster, gbs: int, space: planner.Space) -> str:
    tps = [t for t in space.tp if shape.num_attention_heads % t == 0 and shape.groups % t == 0]
    parts = [f"no parallel plan of {shape.num_layers} layers fits {cluster.gpus} GPUs with global batch {gbs}"]
    if not tps:
        parts.append(f"heads {shape.num_attention_heads} / query groups {shape.groups} divide by none of TP {list(space.tp)}")
    if space.pp and min(space.pp) > shape.num_layers:
        parts.append(f"layers {shape.num_layers} < PP {min(space.pp)}")
    parts.append("check --global-batch-size is a multiple of micro-batch x DP and TP divides the GPUs")
    return "; ".join(parts)
