"""The plan's outputs: the JSON contract of DESIGN.md, the console table, the per-stage PNG."""
from __future__ import annotations

import json

from capture_megatron import baselines
from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan
from capture_megatron.emit import model_args, plan_args
from capture_megatron.planner import Evaluated, rank_peak_fn
from capture_megatron.predict import StageMemory, find_variant, sizes_for, variant_of

PARTS = ("params", "grads", "optimizer", "activations", "transient", "other")


def _breakdown(stages: tuple[StageMemory, ...]) -> list[dict]:
    return [{"pp_rank": s.pp_rank, **{k: int(getattr(s, k)) for k in PARTS}, "phase": s.phase} for s in stages]


def baseline_partitions(model, shape: ModelShape, plan: ParallelPlan) -> list[baselines.Baseline]:
    """Uniform, the best Megatron first/last choice and DeepSpeed's 'parameters' split at the plan's sizes."""
    peak = rank_peak_fn(model, shape, plan, plan.recompute.granularity == "full")
    sc = find_variant(model, variant_of(shape, plan)).constants(sizes_for(shape, plan))
    emb, head = sum(sc.chunk("first").end_numels), sum(sc.chunk("last").end_numels)
    return [baselines.uniform(shape.num_layers, plan.pp, plan.vpp, peak),
            baselines.megatron_first_last(shape.num_layers, plan.pp, plan.vpp, peak),
            baselines.deepspeed_parameters(shape.num_layers, plan.pp, plan.vpp, emb, sum(sc.layer_numels), head, peak)]


def _baselines(model, shape: ModelShape, best: Evaluated) -> dict:
    out = {}
    for b in baseline_partitions(model, shape, best.plan):
        if b.partition is None:
            out[b.name] = {"unavailable": b.reason}
            continue
        entry = {"layers_per_stage": list(b.partition.layers_per_stage),
                 "predicted_peak_bytes": [int(x) for x in b.partition.rank_peaks],
                 "reduction_by_plan": 1 - best.peak / b.partition.peak}
        if b.flags:
            entry["megatron_args"] = list(b.flags)
        out[b.name] = entry
    return out


def plan_json(model, shape: ModelShape, best: Evaluated, cluster: Cluster) -> dict:
    """DESIGN.md's plan JSON."""
    p = best.plan
    return {
        "plan": {"tp": p.tp, "pp": p.pp, "dp": p.dp, "vpp": p.vpp, "micro_batch_size": p.micro_batch_size,
                 "global_batch_size": p.global_batch_size, "layers_per_stage": list(p.layers_per_stage),
                 "layout": p.layout, "recompute": {"granularity": p.recompute.granularity,
                                                   "method": p.recompute.method,
                                                   "num_layers": list(p.recompute.num_layers)},
                 "sequence_parallel": p.sequence_parallel, "distributed_optimizer": p.distributed_optimizer},
        "predicted_peak_bytes": [int(s.peak) for s in best.stages],
        "breakdown": _breakdown(best.stages),
        "megatron_args": plan_args(p),
        "model_args": model_args(shape),
        "baselines": _baselines(model, shape, best),
        "needed_bytes_per_gpu": int(best.needed),
        "gpu_memory_bytes": cluster.gpu_memory_bytes,
        "fits": best.fits,
        "estimated_step_seconds": best.step_seconds,
        "memory_model": {"device": model.device, "transformer_impl": model.transformer_impl,
                         "versions": list(model.versions)},
    }


def write_json(out: dict, path: str) -> None:
    """Write the plan JSON."""
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def print_table(shape: ModelShape, cluster: Cluster, ranked: list[Evaluated], considered: int, out: dict) -> None:
    """The top plans, the chosen plan's stages, and the baselines."""
    unit, uname = unit_of(max(e.peak for e in ranked))
    gib = lambda x: f"{x / unit:8.3f}"  # noqa: E731
    print(f"{considered} plans considered for {shape.num_layers} layers x h {shape.hidden_size} on {cluster.gpus} "
          f"GPUs of {cluster.gpu_memory_bytes / GIB:g} GiB (memory model: {out['memory_model']['device']})")
    print(f"  {'TP':>3} {'PP':>3} {'DP':>4} {'VPP':>3} {'mbs':>3} {'recompute':>9} {'SP':>3} {'DO':>3} "
          f"{'peak ' + uname:>9} {'need ' + uname:>9} {'fits':>4} {'step s':>8}  layout")
    for e in ranked:
        p = e.plan
        print(f"  {p.tp:3d} {p.pp:3d} {p.dp:4d} {p.vpp:3d} {p.micro_batch_size:3d} {p.recompute.granularity:>9} "
              f"{'y' if p.sequence_parallel else 'n':>3} {'y' if p.distributed_optimizer else 'n':>3} "
              f"{gib(e.peak):>9} {gib(e.needed):>9} {'yes' if e.fits else 'no':>4} {e.step_seconds:8.3f}  {p.layout}")
    print(f"chosen plan, per pipeline rank ({uname}):")
    print(f"  {'rank':>4} " + " ".join(f"{k:>11}" for k in PARTS) + f" {'peak':>9}  phase")
    for row, peak in zip(out["breakdown"], out["predicted_peak_bytes"]):
        print(f"  {row['pp_rank']:4d} " + " ".join(f"{row[k] / unit:11.3f}" for k in PARTS)
              + f" {peak / unit:9.3f}  {row['phase']}")
    for name, b in out["baselines"].items():
        if "unavailable" in b:
            print(f"  {name:22s} unavailable: {b['unavailable']}")
        else:
            print(f"  {name:22s} worst rank {max(b['predicted_peak_bytes']) / unit:8.3f} {uname}, layers "
                  f"{b['layers_per_stage']}; the plan is {100 * b['reduction_by_plan']:.1f}% lower")
    print("megatron_args: " + " ".join(out["megatron_args"]))


def unit_of(nbytes: float) -> tuple[float, str]:
    """(divisor, name): GiB for large values, MiB below 1 GiB."""
    return (GIB, "GiB") if nbytes >= GIB else (2 ** 20, "MiB")


def save_png(out: dict, path: str) -> None:
    """Stacked per-stage breakdown of the plan, beside uniform's predicted peaks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["breakdown"]
    ranks = [r["pp_rank"] for r in rows]
    unit, name = unit_of(max(out["predicted_peak_bytes"]))
    fig, ax = plt.subplots(figsize=(2.8 + 0.9 * len(ranks), 4.2))
    bottom = [0.0] * len(rows)
    for part in PARTS:
        vals = [r[part] / unit for r in rows]
        ax.bar(ranks, vals, bottom=bottom, label=part, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    uni = out["baselines"].get("uniform", {})
    if "predicted_peak_bytes" in uni:
        ax.plot(ranks, [x / unit for x in uni["predicted_peak_bytes"]], "k_", markersize=28, mew=2,
                label="uniform layout's peak")
    ax.set_xticks(ranks)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel(name)
    ax.set_title(f"predicted peak per stage, layout {out['plan']['layout']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
