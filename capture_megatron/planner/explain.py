"""Why the planner chose its plan, in a few factual lines, and the best plan stock Megatron-LM runs
beside a plan that needs capture-megatron's per-stage recompute. Pure Python.

The reasons name the objective's measure of the chosen plan and what the simpler setups would
need at the same global batch: plain data parallelism (TP 1, PP 1) and the chosen sizes without
recompute -- each only when the planner chose that part of the plan (nothing is said about sizes
given on the command line) and the memory model holds its variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan, Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.features.activation_offload import ActivationOffload
from capture_megatron.fit import MemoryModel
from capture_megatron.planner.balance import Evaluated, balanced, evaluate_plan
from capture_megatron.planner.baselines import Baseline, baselines_for
from capture_megatron.planner.emit import stock_recompute_count
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.offload_space import activation_ddp, offload_ddp
from capture_megatron.planner.partition import TIE
from capture_megatron.planner.space import Space
from capture_megatron.steptime.model import CostModel


@dataclass(frozen=True)
class Context:
    """What explaining a planning run needs: its model, cluster, space, margins and objective."""

    model: MemoryModel
    """The memory model the plans were predicted with."""
    shape: ModelShape
    """The model planned."""
    cluster: Cluster
    """The machines planned for."""
    space: Space
    """What the search could choose (one-element tuples: given on the command line)."""
    margins: Margins
    """The allocator / CUDA context margins."""
    hw: CostModel
    """The cost model's hardware."""
    objective: str
    """min-peak, throughput or min-gpus; 'fixed' for a plan given whole (only predicted)."""
    activation_reach: tuple[str, ...] = ()
    """min-peak: the largest fine-grained activation offloading module set Megatron-LM could run
    here (offload_space.activation_sets; empty where it could not, or the records do not say
    what offloading moves), for the lowest device peak the reasoning reports."""

    def evaluate(self, plan: ParallelPlan) -> Evaluated | None:
        """The plan predicted, or None when the memory model lacks its variant."""
        try:
            return evaluate_plan(self.model, self.shape, plan, self.cluster, self.margins, self.hw)
        except CaptureError:
            return None


def units(cluster: Cluster) -> str:
    """What the cluster's devices are called: GPUs, or processes for a CPU run."""
    return "processes" if cluster.device == "cpu" else "GPUs"


def gib(nbytes: float) -> str:
    """Bytes as GiB with one decimal, e.g. '23.5 GiB'."""
    return f"{round(nbytes / GIB, 1):g} GiB"


def ranked_key(objective: str) -> Callable[[Evaluated], tuple]:
    """The sort key of an objective: fitting plans first, then its measure."""
    if objective == "throughput":
        return lambda e: (not e.fits, e.step_seconds, e.peak)
    return lambda e: (not e.fits, e.peak, e.step_seconds)


def reasoning(ctx: Context, ranked: tuple[Evaluated, ...], considered: int) -> tuple[str, ...]:
    """Why ranked[0] was chosen and what the simpler setups need, one sentence each."""
    lines = [_why(ctx, ranked, considered)]
    if ctx.objective != "fixed":
        lines += [
            line
            for line in (
                _plain_dp(ctx, ranked[0]),
                _no_recompute(ctx, ranked[0]),
                _offload_reach(ctx, ranked[0]),
                _activation_trade(ctx, ranked[0]),
            )
            if line
        ]
    return tuple(lines)


def _offload_reach(ctx: Context, best: Evaluated) -> str:
    """min-peak on GPUs, a plan without optimizer offload: the worst-rank peak of the same plan
    with all of its optimizer offloaded (the lowest device peak its sizes reach; min-peak does not
    offload unless --optimizer-cpu-offload is given) ('' otherwise)."""
    p = best.plan
    if ctx.objective != "min-peak" or ctx.cluster.device == "cpu" or p.ddp.optimizer_cpu_offload:
        return ""
    try:
        moved = replace(p, distributed_optimizer=True, ddp=offload_ddp(p.ddp, 1.0))
    except CaptureError:  # Megatron-LM refuses offload with the settings given
        return ""
    e = ctx.evaluate(moved)
    if e is None or e.peak >= best.peak:
        return ""
    return (
        f"with all of its optimizer offloaded (--optimizer-cpu-offload with the distributed and "
        f"precision-aware optimizers) the plan's worst-rank peak would be {gib(e.peak)} "
        f"(-{gib(best.peak - e.peak)}), at an estimated {e.step_seconds - best.step_seconds:+.2f} "
        f"s per step and {gib(e.host_per_node)} of host memory per node" + _activation_reach(ctx, e)
    )


def _activation_reach(ctx: Context, moved: Evaluated) -> str:
    """After _offload_reach: whether offloading the activations of every module group Megatron-LM
    allows here, instead of recomputing (a layer recomputed in full saves only its input, so
    offloading gains nothing beside it), reaches a lower peak than `moved` ('' where the kernel
    set cannot offload activations or the plan does not recompute)."""
    p, modules = moved.plan, ctx.activation_reach
    if not modules or p.recompute.granularity == "none":
        return ""
    offloaded = replace(p, recompute=Recompute(), ddp=activation_ddp(p.ddp, modules))
    try:
        light = ctx.evaluate(balanced(ctx.model, ctx.shape, offloaded))
    except CaptureError:
        return ""
    if light is None:
        return ""
    what = f"the activations of {', '.join(modules)} (--fine-grained-activation-offloading)"
    if light.peak >= moved.peak:
        return (
            f"; offloading {what} instead of recomputing would not lower it ({gib(light.peak)}): "
            "that is the lowest device peak these sizes reach"
        )
    return (
        f"; offloading {what} as well, instead of recomputing, would take it to {gib(light.peak)}"
        f" at an estimated {light.step_seconds - moved.step_seconds:+.2f} s per step more and "
        f"{gib(light.host_per_node)} of host memory per node: the lowest device peak these sizes "
        "reach"
    )


def _activation_trade(ctx: Context, best: Evaluated) -> str:
    """A plan whose fine-grained activation offloading the planner chose: what it saves on the
    worst rank and costs per step against the same plan without it ('' otherwise)."""
    p, searched = best.plan, len(ctx.space.activation_offload) > 1
    groups = p.ddp.activation_offload.groups
    if not searched or not groups:
        return ""
    e = ctx.evaluate(replace(p, ddp=replace(p.ddp, activation_offload=ActivationOffload())))
    if e is None:
        return ""
    return (
        f"the planner offloads the activations of {', '.join(groups)} "
        f"(--fine-grained-activation-offloading; --no-activation-offload keeps it off): the "
        f"worst-rank peak {gib(best.peak)} (-{gib(e.peak - best.peak)}) at an estimated "
        f"{best.step_seconds - e.step_seconds:+.2f} s per step and {gib(best.host_per_node)} of "
        f"host memory per node; without it the same plan {_versus(ctx, e)}"
    )


def _why(ctx: Context, ranked: tuple[Evaluated, ...], considered: int) -> str:
    best, gpu = ranked[0], ctx.cluster.device != "cpu"
    if ctx.objective == "fixed":
        return "the run the flags describe is predicted as given; nothing is searched"
    if ctx.objective == "min-gpus":
        return (
            f"the fewest {units(ctx.cluster)} on which a plan fits: {best.plan.world_size} of "
            f"{ctx.cluster.gpus} (objective min-gpus)"
        )
    if ctx.objective == "min-peak":
        why = f"the lowest predicted worst-rank peak ({gib(best.peak)})"
    elif gpu:
        why = f"the fastest estimated step ({best.step_seconds:.2f} s) that fits"
    else:
        why = "the fastest that fits by the cost model's estimate (made for GPUs; not shown)"
    why += f", of the {considered} plans balanced and predicted (objective {ctx.objective})"
    rc = best.plan.recompute
    if rc.granularity == "full" and ctx.objective == "throughput" and not ctx.space.keeps_recompute:
        why += f"; full recompute of {list(rc.num_layers)} layers per stage: the fewest that fit"
    return why


def _versus(ctx: Context, e: Evaluated) -> str:
    """'needs X > Y' or 'fits (needs X), slower / higher peak' for a simpler setup."""
    cap = gib(ctx.cluster.gpu_memory_bytes)
    if not e.fits:
        return f"needs {gib(e.needed)} > {cap}"
    if ctx.objective == "throughput" and ctx.cluster.device != "cpu":
        return f"fits ({gib(e.needed)} of {cap}) at an estimated {e.step_seconds:.2f} s per step"
    return f"fits ({gib(e.needed)} of {cap}) with a worst-rank peak of {gib(e.peak)}"


def plain_dp(shape: ModelShape, space: Space, p: ParallelPlan) -> ParallelPlan | None:
    """Plain data parallelism on the plan's GPUs and batch (None when the space, the batch or the
    flex dispatcher rules it out, or the plan is it)."""
    if (p.tp, p.pp) == (1, 1) or len(space.tp) == 1 or len(space.pp) == 1 or 1 not in space.tp:
        return None
    if shape.moe.enabled and shape.moe.moe_token_dispatcher_type == "flex":
        return None  # EP 1: megatron-core's flex dispatcher asserts expert TP x EP > 1
    n, gbs = p.world_size, p.global_batch_size
    mbs = p.micro_batch_size if gbs % (p.micro_batch_size * n) == 0 else 1
    distopt = n > 1 and True in space.distributed_optimizer
    if gbs % (mbs * n) or space.ddp.plan_problems(1, 1, n, n, distopt):
        return None
    return ParallelPlan(
        tp=1,
        pp=1,
        dp=n,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        layers_per_stage=(shape.num_layers,),
        distributed_optimizer=distopt,
        ddp=space.ddp,
        mtp_layers=p.mtp_layers,
    )


def plans_explained(shape: ModelShape, space: Space, best: ParallelPlan) -> list[ParallelPlan]:
    """The plans the reasoning predicts beside the chosen one (their memory must be known)."""
    plain = plain_dp(shape, space, best)
    return [replace(best, recompute=Recompute())] + ([plain] if plain is not None else [])


def _plain_dp(ctx: Context, best: Evaluated) -> str:
    plain = plain_dp(ctx.shape, ctx.space, best.plan)
    e = None if plain is None else ctx.evaluate(plain)
    if plain is None or e is None:
        return ""
    what = (
        f"TP 1, PP 1, DP {plain.dp}, micro-batch {plain.micro_batch_size}"
        f"{', distributed optimizer' if plain.distributed_optimizer else ''}"
    )
    return f"plain data parallelism ({what}, no recompute) {_versus(ctx, e)}"


def _no_recompute(ctx: Context, best: Evaluated) -> str:
    p, space = best.plan, ctx.space
    if p.recompute.granularity == "none" or "none" not in space.recompute:
        return ""
    try:
        light = balanced(ctx.model, ctx.shape, replace(p, recompute=Recompute()))
    except CaptureError:
        return ""
    e = ctx.evaluate(light)
    if e is None:
        return ""
    return f"the same sizes without recompute (layers re-balanced) {_versus(ctx, e)}"


def is_stock(plan: ParallelPlan) -> bool:
    """Whether stock Megatron-LM flags express the plan's recompute (no per-stage counts)."""
    return plan.recompute.granularity != "full" or stock_recompute_count(plan) is not None


def stock_alternative(ctx: Context, ranked: tuple[Evaluated, ...]) -> Evaluated | None:
    """The best plan stock Megatron-LM runs, when ranked[0] needs per-stage recompute counts
    (None otherwise): the chosen sizes and layout with its largest count on every stage (the
    fewest layers one count can recompute and still fit, as each stage's count is its fewest),
    or a ranked plan with stock flags that the objective puts ahead of it."""
    best = ranked[0]
    if is_stock(best.plan):
        return None
    n = max(best.plan.recompute.num_layers)
    same = ctx.evaluate(
        replace(best.plan, recompute=Recompute("full", "block", (n,) * best.plan.pp))
    )
    options = [e for e in ranked[1:] if e.fits and is_stock(e.plan)]
    options += [same] if same is not None else []
    if not options:
        return None
    return min(options, key=ranked_key(ctx.objective))


def _better(b: Baseline, best: Evaluated) -> bool:
    """Whether a baseline that fits is faster than the plan, or as fast with a lower peak."""
    if b.partition is None or not b.fits:
        return False
    if b.step_seconds < best.step_seconds * (1 - TIE):
        return True
    return b.step_seconds <= best.step_seconds * (1 + TIE) and b.partition.peak < best.peak * (
        1 - TIE
    )


def not_below_baselines(
    ctx: Context, ranked: tuple[Evaluated, ...], fixed: bool
) -> tuple[tuple[Evaluated, ...], tuple[Baseline, ...]]:
    """(the ranking, the chosen plan's baselines): for the throughput and min-gpus objectives no
    plan is slower than a baseline of its own sizes that fits -- a faster one (or one as fast
    with a lower peak) takes its place (the time-aware split of more than two chunks per rank
    searches near-even chunks only, and dense and MoE layers mixed keep the memory split)."""
    given = fixed or ctx.space.keeps_recompute
    floor = 1 if ctx.space.recompute == ("full",) else 0
    best = ranked[0]
    for _ in range(4):
        found = baselines_for(
            ctx.model, ctx.shape, best.plan, ctx.cluster, ctx.margins, ctx.hw, given, floor
        )
        better = [b for b in found if _better(b, best)]
        if fixed or ctx.objective not in ("throughput", "min-gpus") or not better:
            return ranked, found
        b = min(better, key=lambda b: (b.step_seconds, b.needed))
        assert b.partition is not None
        split = replace(best.plan, layers_per_stage=b.partition.layers_per_stage)
        e = ctx.evaluate(replace(split, recompute=b.recompute))
        if e is None or not e.fits:
            return ranked, found
        e = replace(e, bound=min(best.bound, e.step_seconds) if best.bound else 0.0)
        ranked = (e,) + tuple(x for x in ranked[1:] if x.plan != e.plan)
        best = e
    return ranked, found


def _split_words(b: Baseline) -> str:
    """A baseline's layers and recompute, briefly."""
    assert b.partition is not None
    rc = b.recompute
    what = "no recompute" if rc.granularity == "none" else f"{rc.granularity} recompute"
    if rc.granularity == "full":
        what += f" of {list(rc.num_layers)} layers per stage"
    return f"layers {list(b.partition.layers_per_stage)}, {what}"


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%" if abs(x) < 0.01 else f"{100 * x:.0f}%"


def trade(ctx: Context, best: Evaluated, baselines: tuple[Baseline, ...]) -> tuple[str, ...]:
    """For a plan chosen for time, what the memory-balanced and the uniform split of the same
    sizes would cost, in words ('memory-balanced split (...): 2.3 GiB lower peak, 14% slower; not
    needed: 6 GiB headroom'); empty for the other objectives."""
    if ctx.objective not in ("throughput", "min-gpus"):
        return ()
    cap, gpu = ctx.cluster.gpu_memory_bytes, ctx.cluster.device != "cpu"
    lines = []
    for b in baselines:
        if b.name not in ("memory-balanced", "uniform"):
            continue
        label = f"{b.name} split"
        if b.partition is None:
            lines.append(f"{label}: unavailable ({b.reason})")
            continue
        if (b.partition.layers_per_stage, b.recompute) == (
            best.plan.layers_per_stage,
            best.plan.recompute,
        ):
            lines.append(f"{label}: the plan's own layout")
            continue
        lower = best.peak - b.partition.peak
        words = [f"{gib(abs(lower))} {'lower' if lower > 0 else 'higher'} peak"]
        if abs(lower) < 0.05 * GIB:
            words = ["the same peak"]
        slower = b.step_seconds / best.step_seconds - 1
        if gpu:
            pace = "as fast" if abs(slower) < TIE else _percent(abs(slower))
            words.append(
                pace + (" slower" if slower >= TIE else " faster" if slower <= -TIE else "")
            )
        tail = ""
        if not b.fits:
            tail = f"; does not fit (needs {gib(b.needed)} > {gib(cap)})"
        elif lower > 0:
            tail = f"; not needed: {gib(cap - best.needed)} headroom"
        lines.append(f"{label} ({_split_words(b)}): {', '.join(words)}{tail}")
    return tuple(lines)
