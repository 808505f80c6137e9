"""What the commands print and plot: the plan table, the per-stage breakdown PNG, predicted vs
measured per rank (verify), and the fit-quality table."""

from __future__ import annotations

from types import ModuleType

from capture_megatron.config import GIB, ParallelPlan, Recompute
from capture_megatron.config.kernels import VALIDATION
from capture_megatron.features.activation_offload import OFFLOAD_SETS
from capture_megatron.fit import MemoryModel
from capture_megatron.fit.quality import quality_rows, used_error
from capture_megatron.planner import PlanResult
from capture_megatron.planner.explain import units
from capture_megatron.planner.offload_space import activation_rank
from capture_megatron.planner.result import PARTS
from capture_megatron.train.compare import RankCheck

MIB = 2**20
"""Bytes in a MiB."""


def unit_of(nbytes: float) -> tuple[float, str]:
    """(divisor, name): GiB for large values, MiB below 1 GiB."""
    return (GIB, "GiB") if nbytes >= GIB else (MIB, "MiB")


def print_plan(result: PlanResult) -> None:
    """The top plans with a legend, why the first was chosen, its stages, the baselines and its
    Megatron flags (with the stock Megatron-LM alternative when they need capture-megatron)."""
    unit, uname = unit_of(max(e.peak for e in result.ranked))
    shape, cluster = result.shape, result.cluster
    print(
        f"{result.considered} plans considered for {shape.num_layers} layers x h "
        f"{shape.hidden_size} on {cluster.gpus} {units(cluster)} of "
        f"{_memory(cluster.gpu_memory_bytes)} (memory model: {result.origin.device}, kernels "
        f"{result.origin.kernels}, megatron-core {result.megatron_core})"
    )
    print(f"  validated: {VALIDATION.get(result.origin.device, 'not validated')}")
    if result.read_back:
        print(
            f"  read back from {result.read_back}: the same request, answered before from the "
            "same records by the same code (CAPTURE_MEGATRON_KEEP_PLANS=0 works it out again)"
        )
    wide = shape.moe.enabled or any(e.plan.cp > 1 for e in result.ranked)
    off = any(e.plan.ddp.optimizer_cpu_offload for e in result.ranked)
    act = any(e.plan.ddp.activation_offload.groups for e in result.ranked)
    print(
        f"  {'TP':>3} {'PP':>3} {'DP':>4}{'  CP  EP' if wide else ''} {'VPP':>3} {'mbs':>3} "
        f"{'recompute':>9} {'SP':>3} {'DO':>3}{'  OFF' if off else ''}{'   ACT' if act else ''} "
        f"{'peak ' + uname:>9} "
        f"{'need ' + uname:>9} "
        f"{'fits':>4} {'step s':>7}  layout"
    )
    for e in result.ranked:
        p = e.plan
        print(
            f"  {p.tp:3d} {p.pp:3d} {p.dp:4d}{f' {p.cp:3d} {p.ep:3d}' if wide else ''} "
            f"{p.vpp:3d} {p.micro_batch_size:3d} "
            f"{p.recompute.granularity:>9} {'y' if p.sequence_parallel else 'n':>3} "
            f"{_optimizer(p):>3}{_offload(p) if off else ''}"
            f"{_activations(p) if act else ''} {e.peak / unit:9.2f} "
            f"{e.needed / unit:9.2f} {_fits(e.fits, cluster.gpu_memory_bytes):>4} "
            f"{_step(result, e.step_seconds):>7}  {p.layout}"
        )
    for line in legend(result):
        print(f"  {line}")
    if result.on_gpu:
        print(step_line(result))
    for i, line in enumerate(result.reasoning):
        print(("why: " if i == 0 else "  ") + line)
    _print_stages(result, unit, uname)
    _print_baselines(result, unit, uname)
    _print_args(result, unit, uname)
    for note in result.notes:
        print(f"note: {note}")
    if result.ignored_flags:
        print("ignored (cannot change memory): " + " ".join(result.ignored_flags))


ZERO = {"no_shard": "Z0", "optim": "Z1", "optim_grads": "Z2", "optim_grads_params": "Z3"}
"""The DO column's names of Megatron-FSDP's sharding strategies (ZeRO stages)."""


def _optimizer(plan: ParallelPlan) -> str:
    """The DO column: y / n for Megatron's distributed optimizer, or Megatron-FSDP's ZeRO stage
    (--use-megatron-fsdp; Z3: --data-parallel-sharding-strategy optim_grads_params)."""
    if plan.ddp.fsdp.enabled:
        return ZERO[plan.ddp.fsdp.strategy]
    return "y" if plan.distributed_optimizer else "n"


def _offload(plan: ParallelPlan) -> str:
    """The OFF column: the optimizer's fraction offloaded (--optimizer-cpu-offload; 0 without)."""
    ddp = plan.ddp
    return f" {ddp.optimizer_offload_fraction if ddp.optimizer_cpu_offload else 0:4g}"


ACT_SETS = {1: "attn", 2: "layer", 3: "all"}
"""The ACT column's names of plan.offload_space's module sets (OFFLOAD_SETS), by rank."""


def _activations(plan: ParallelPlan) -> str:
    """The ACT column: the module set fine-grained activation offloading moves ('-' without;
    'set' for a set the command line gave that is none of the searched ones)."""
    groups = plan.ddp.activation_offload.groups
    name = (
        "-"
        if not groups
        else "set"
        if groups not in OFFLOAD_SETS
        else ACT_SETS[activation_rank(plan.ddp)]
    )
    return f" {name:>5}"


def legend(result: PlanResult) -> list[str]:
    """What the table's columns mean, once."""
    m, memory = result.margins, _memory(result.cluster.gpu_memory_bytes)
    calibrated = f" x {m.calibration:.3f} calibration" if m.calibration != 1.0 else ""
    if m.on_cpu:
        need = f"need = peak{calibrated} (CPU processes: no allocator reserve or CUDA context)"
        step = "step s: not estimated for CPU processes (the cost model is for GPUs)"
    else:
        need = (
            f"need = peak{calibrated} + allocator reserve ({100 * m.reserve_fraction:g}%) + "
            f"CUDA context and NCCL ({m.context_bytes / GIB:g} GiB)"
        )
        if m.hybridep_domain:
            need += " + HybridEP's communication buffers (outside the allocator)"
        if m.deepep_sms:
            need += " + DeepEP's communication buffers (outside the allocator)"
        step = (
            "step s: the step-time model's estimate per optimizer step on the --gpu-type "
            "(docs/STEP_TIME.md), to rank plans"
        )
    fits = f"need <= {memory}" if result.cluster.gpu_memory_bytes else "- (no --gpu-memory-gib)"
    peak = "predicted peak of allocated memory on the worst pipeline rank"
    if result.routing is not None:
        peak += " (dropless MoE: at the routing forecast)"
        need = need.replace("need = peak", "need = the peak at the MoE planning factor", 1)
    return [
        f"peak: {peak}; {need}; fits: {fits}",
        f"{step}; SP sequence parallel, DO distributed optimizer (Z0-Z3: Megatron-FSDP "
        "instead, --use-megatron-fsdp, with --data-parallel-sharding-strategy no_shard, optim, "
        "optim_grads or optim_grads_params), CP context-parallel and EP "
        "expert-parallel sizes (shown for MoE or CP plans), OFF the optimizer's fraction "
        "offloaded (--optimizer-cpu-offload; shown when a plan offloads), ACT the activations "
        "offloaded (--offload-modules: attn core_attn attn_proj, layer also attn_norm "
        "qkv_linear mlp_norm, all also expert_fc1 moe_act; shown when a plan offloads), VPP "
        "virtual stages per "
        "rank, mbs micro-batch size; layout: --pipeline-model-parallel-layout (E embedding, "
        "t layer, L output layer, | between stages)",
    ]


def step_line(result: PlanResult) -> str:
    """The chosen plan's estimated step: seconds, tokens/s/GPU, model TFLOP/s/GPU and MFU."""
    st, hw = result.step, result.cost.hardware
    return (
        f"estimated step: {st.seconds:.3f} s on {hw.name} ({hw.peak_flops / 1e12:.0f} TFLOP/s "
        f"dense bf16): {st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {st.tflops_per_gpu:.0f} model "
        f"TFLOP/s/GPU (MFU {st.mfu:.1%}); pipeline bubble {st.bubble:.3f} s, data-parallel "
        f"communication left exposed {st.data_parallel:.3f} s, optimizer {st.optimizer:.3f} s"
    )


def _memory(nbytes: int) -> str:
    return f"{round(nbytes / GIB, 1):g} GiB" if nbytes else "unstated memory"


def _step(result: PlanResult, seconds: float) -> str:
    """The estimated step time, or '-' where the cost model does not apply (CPU processes)."""
    return f"{seconds:.3f}" if result.on_gpu else "-"


def _fits(fits: bool, memory: int) -> str:
    """yes / no, or '-' when no GPU memory was given (predict without --gpu-memory-gib)."""
    return "-" if not memory else "yes" if fits else "no"


def _recompute_words(rc: Recompute) -> str:
    if rc.granularity == "full":
        return f"full recompute ({rc.method}) of {list(rc.num_layers)} layers per stage"
    return "no recompute" if rc.granularity == "none" else "selective recompute"


def host_node_words(result: PlanResult) -> str:
    """The host bytes of one node's ranks against the hardware's host memory."""
    per_node, limit = result.best.host_per_node, result.cost.hardware.host_memory_bytes
    ranks = min(result.cluster.gpus_per_node, result.cluster.gpus)
    verdict = "fits" if per_node <= limit else "does NOT fit"
    return (
        f"{ranks} ranks per node hold {per_node / GIB:.1f} GiB, which {verdict} the node's "
        f"{limit / GIB:g} GiB of host memory (--host-memory-gib)"
    )


def _print_stages(result: PlanResult, unit: float, uname: str) -> None:
    best = result.best
    host = any(s.host_total for s in best.stages)  # optimizer / activation offload: a host column
    print(f"chosen plan, per pipeline rank ({uname}; {_recompute_words(best.plan.recompute)}):")
    print(
        f"  {'rank':>4} {'layers':>6} {'in flight':>9} "
        + " ".join(f"{k:>11}" for k in PARTS)
        + f" {'peak':>9}  phase"
        + (f" {'host':>9}" if host else "")
    )
    for s, peak in zip(best.stages, best.rank_peaks):
        parts = " ".join(f"{int(getattr(s, k)) / unit:11.3f}" for k in PARTS)
        layers = best.plan.layers_of(s.pp_rank)
        alive = "+".join(str(n) for n in s.inflight)
        row = f"  {s.pp_rank:4d} {layers:6d} {alive:>9} {parts} {peak / unit:9.3f}  {s.phase:8s}"
        print((row + f" {s.host_total / unit:9.3f}") if host else row.rstrip())
    if host:
        print(
            "  host: host memory per rank (--optimizer-cpu-offload: the optimizer's host copies, "
            "moments and gradients; fine-grained activation offloading: the offloaded groups of "
            "the micro-batches in flight), not in the peak; " + host_node_words(result)
        )
    print(
        "  in flight: micro-batches alive per chunk at the peak; activations: what they hold, "
        "the running one included (its saved tensors so far; with full recompute the layers "
        "recomputed for its backward); transient: the running forward / backward / step's "
        "temporaries beyond that; other: Megatron's global buffers, GPU workspaces, the MoE "
        "dispatchers' routing state and MLA's rotary tables"
    )


def _print_baselines(result: PlanResult, unit: float, uname: str) -> None:
    print("other systems' splits at the plan's sizes and recompute:")
    for b in result.baselines:
        if b.partition is None:
            print(f"  {b.name:22s} {result.comparison(b)}")
            continue
        same = b.recompute == result.best.plan.recompute
        rc = "the same recompute" if same else _recompute_words(b.recompute)
        print(
            f"  {b.name:22s} layers {list(b.partition.layers_per_stage)}, {rc}: worst rank "
            f"{b.partition.peak / unit:.2f} {uname}; {result.comparison(b)}"
        )


def _print_args(result: PlanResult, unit: float, uname: str) -> None:
    print("megatron_args: " + " ".join(result.megatron_args()))
    for note in result.flag_notes():
        print(f"  needs: {note}")
    alt = result.stock_alternative
    if alt is None:
        return
    step = f", step {alt.step_seconds:.3f} s" if result.on_gpu else ""
    print(
        f"stock Megatron-LM alternative (TP {alt.plan.tp}, PP {alt.plan.pp}, DP {alt.plan.dp}, "
        f"{_recompute_words(alt.plan.recompute)}): peak {alt.peak / unit:.2f} {uname}, need "
        f"{alt.needed / unit:.2f} {uname}{step}"
    )
    print("  megatron_args: " + " ".join(result.megatron_args(alt)))


def save_plan_png(result: PlanResult, path: str) -> None:
    """Stacked per-stage breakdown of the chosen plan, beside uniform's predicted peaks."""
    plt = _pyplot()
    stages = result.best.stages
    ranks = [s.pp_rank for s in stages]
    unit, name = unit_of(max(result.best.rank_peaks))
    fig, ax = plt.subplots(figsize=(2.8 + 0.9 * len(ranks), 4.2))
    bottom = [0.0] * len(stages)
    for part in PARTS:
        vals = [int(getattr(s, part)) / unit for s in stages]
        ax.bar(ranks, vals, bottom=bottom, label=part, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    uniform = result.baseline("uniform").partition
    if uniform is not None:
        peaks = [int(x) / unit for x in uniform.rank_peaks]
        ax.plot(ranks, peaks, "k_", markersize=28, mew=2, label="uniform layout's peak")
    ax.set_xticks(ranks)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel(name)
    ax.set_title(f"predicted peak per stage, layout {result.best.plan.layout}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_checks(rows: list[RankCheck], tolerance: float) -> None:
    """The verification table; on a GPU also the forecast made without it (fake CUDA)."""
    fake = any(c.without_gpu_bytes is not None for c in rows)
    extra = f" {'without GPU MiB':>16} {'error':>8}" if fake else ""
    print(
        f"  {'rank':>4} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8} "
        f"{'reserved MiB':>13}{extra}"
    )
    for c in rows:
        flag = "" if abs(c.error) <= tolerance else "  <-- off"
        other = ""
        if c.without_gpu_bytes is not None:
            other = f" {c.without_gpu_bytes / MIB:16.3f} {100 * (c.without_gpu_error or 0):+7.2f}%"
        print(
            f"  {c.pp_rank:4d} {c.predicted_bytes / MIB:14.3f} {c.measured_bytes / MIB:13.3f} "
            f"{100 * c.error:+7.2f}% {c.reserved_bytes / MIB:13.3f}{other}{flag}"
        )
    if fake:
        print(
            "  (without GPU: the same plan forecast from the GPU kernel set on fake CUDA tensors, "
            "as `predict` forecasts it on a machine without the GPU)"
        )


def save_checks_png(rows: list[RankCheck], path: str, title: str) -> None:
    """Predicted vs measured bars per rank."""
    plt = _pyplot()
    unit, name = unit_of(max(c.measured_bytes for c in rows))
    xs = [c.pp_rank for c in rows]
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * len(xs), 3.8))
    ax.bar(
        [x - 0.2 for x in xs],
        [c.predicted_bytes / unit for c in rows],
        width=0.4,
        label="predicted",
    )
    ax.bar(
        [x + 0.2 for x in xs], [c.measured_bytes / unit for c in rows], width=0.4, label="measured"
    )
    for c in rows:
        top = max(c.predicted_bytes, c.measured_bytes) / unit
        ax.annotate(
            f"{100 * c.error:+.1f}%", (c.pp_rank, top), ha="center", va="bottom", fontsize=7
        )
    ax.set_xticks(xs)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel(f"peak allocated, {name}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_quality(model: MemoryModel) -> None:
    """The fit-quality table: every row's leave-one-out error, the regression rows a replayed
    timeline replaces marked as not used, and the largest error of what predictions use."""
    v = model.versions
    print(
        f"memory model: {model.device}, kernels {model.kernels}, capture-megatron {v[0]}, "
        f"torch {v[1]}, megatron-core {v[2]}"
    )
    print(
        f"  {'variant':22s} {'quantity':34s} {'probes':>6s} {'max resid B':>12s} "
        f"{'LOO max err':>12s}"
    )
    rows = quality_rows(model)
    for r in rows:
        unused = f"  not used: {r.replaced_by} replaces it" if r.replaced_by else ""
        print(
            f"  {r.variant:22s} {r.quantity:34s} {r.samples:6d} {r.max_abs_residual:12.0f} "
            f"{100 * r.loo_max_rel_error:11.3f}%{unused}"
        )
    worst = used_error(rows)
    if worst is not None:
        replaced = sum(1 for r in rows if r.replaced_by)
        print(
            f"largest leave-one-out error of what predictions use: "
            f"{100 * worst.loo_max_rel_error:.3f}% ({worst.variant} {worst.quantity}; exact at "
            "the probed shapes)"
            + (
                f"; {replaced} regression rows are not used (a timeline replaces them)"
                if replaced
                else ""
            )
        )


def _pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend, imported on demand (slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
