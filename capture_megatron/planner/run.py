"""plan(): the planning step from a model and a cluster to a PlanResult (pure Python).

The memory model comes ready (a MemoryModel) or from a ModelSource, which is asked for the
(variant, probe shape) pairs of the plans the search visits (capture_megatron.planner.supply;
capture_megatron.profile.memory_source profiles them on the spot and caches them). With a fixed
plan nothing is searched: the result holds its prediction. Otherwise the candidates of the search
space are balanced and ranked by the objective, and when none fits, the error names the smallest
setup that would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from capture_megatron.config import GIB, Cluster, Kernels, ModelShape, ParallelPlan
from capture_megatron.config.kernels import kernel_set
from capture_megatron.config.model import tp_head_problems
from capture_megatron.errors import CaptureError
from capture_megatron.fields import flag
from capture_megatron.fit import MemoryModel, ModelSource
from capture_megatron.forecast.layers import single_micro_batches
from capture_megatron.forecast.offload import measured
from capture_megatron.planner.explain import (
    Context,
    not_below_baselines,
    plans_explained,
    reasoning,
    stock_alternative,
    trade,
)
from capture_megatron.planner.fewest import ClusterSearch
from capture_megatron.planner.margins import CONTEXT_GIB, RESERVE_FRACTION, Margins
from capture_megatron.planner.offload_space import (
    activation_sets,
    searched_fsdp,
    searched_offload,
)
from capture_megatron.planner.result import ModelOrigin, PlanResult
from capture_megatron.planner.routing import (
    at_forecast,
    baselines_at_forecast,
    routed,
    routing_report,
)
from capture_megatron.planner.search import OBJECTIVES, Evaluated, evaluate_plan
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.supply import Supply
from capture_megatron.rules.megatron import flex_problems
from capture_megatron.rules.modelled import (
    check_plans,
    context_problem,
)
from capture_megatron.steptime.model import CostModel


@dataclass(frozen=True)
class PlanOptions:
    """How to plan: what to optimise, what may be searched, and the memory margins."""

    objective: str = flag(
        "--objective",
        "throughput",
        choices=OBJECTIVES,
        note="(throughput, the default: the fastest estimated step among plans that fit; "
        "min-peak: the lowest worst-rank peak; min-gpus: the fewest GPUs on which a plan fits)",
    )
    """What the search optimises."""
    top: int = flag("--top", 8)
    """Plans kept in the ranking (shown in the table)."""
    reserve_fraction: float = flag(
        "--reserve-fraction", RESERVE_FRACTION, note="(calibrate with verify --refit)"
    )
    """CUDA: the caching allocator's reserve above allocated, as a fraction of the peak (default:
    the 1.9% measured on a dense Megatron run, rounded up; docs/MEMORY_MODEL.md, Margins)."""
    context_gib: float = flag("--context-gib", CONTEXT_GIB)
    """CUDA: memory per process outside the allocator (CUDA context, NCCL), in GiB (default: the
    3.9 GiB upper bound measured on a dense Megatron run; docs/MEMORY_MODEL.md, Margins). cuBLAS and
    TE workspaces are allocator memory and are in the forecast itself."""
    cost: CostModel = CostModel()
    """The step-time model: hardware profile, the run's overlap settings, fitted constants."""
    space: Space = Space()
    """What the search may choose (a one-element tuple fixes a value)."""
    global_batch_size: int = 0
    """Sequences per optimizer step; 0: DEFAULT_GLOBAL_BATCH (whatever the GPU count)."""
    fixed: ParallelPlan | None = None
    """Predict this plan instead of searching."""
    calibration: float = 1.0
    """Measured / predicted peak of verified runs on this device (scales the predicted peaks)."""
    kernels: Kernels = Kernels()
    """The layer implementation and fused kernels the run uses (Megatron-LM's defaults)."""
    no_activation_offload: bool = flag("--no-activation-offload", False)
    """Do not search fine-grained activation offloading (tried otherwise on TE GPUs)."""
    notes: tuple[str, ...] = ()
    """What the output adds to a searched plan's reasoning about the search itself (e.g. the
    micro-batch sizes a given memory model predicts: probed_batches)."""

    def margins(
        self, cluster: Cluster, hidden_size: int = 0, flex: str = "", sms: int = 0
    ) -> Margins:
        """The memory margins these options set for `cluster` (and a model of `hidden_size`:
        the userbuffers of --tp-comm-overlap; `flex`: the flex dispatcher's backend, hybridep
        (its buffers over the hardware's NVLink domains) or deepep (its buffers for `sms` SMs),
        '' without flex)."""
        ub = self.kernels.userbuffer_bytes_per_token(hidden_size)
        on_cpu = cluster.device == "cpu"
        domain = self.cost.hardware.nvlink_domain if flex == "hybridep" else 0
        return Margins(
            self.reserve_fraction,
            self.context_gib * GIB,
            self.calibration,
            on_cpu,
            ub,
            domain,
            sms if flex == "deepep" else 0,
        )


DEFAULT_GLOBAL_BATCH = 512
"""Sequences per step when --global-batch-size is not given: the global batch of NVIDIA's NeMo
Llama 3 8B / 70B pretraining recipes (nemo/collections/llm/recipes/llama3_8b.py, llama3_70b.py).
It does not depend on the GPU count: the batch decides the plan (its micro-batches set the
pipeline bubble), so a default that grew with the GPUs would change the plan with them."""


def global_batch(options: PlanOptions, cluster: Cluster) -> int:
    """The global batch: given, else DEFAULT_GLOBAL_BATCH (rounded up to a multiple of a fixed
    micro-batch size); the same on any number of GPUs."""
    mbs = options.space.micro_batch_size
    unit = mbs[0] if len(mbs) == 1 else 1
    return options.global_batch_size or -(-DEFAULT_GLOBAL_BATCH // unit) * unit


def batch_line(options: PlanOptions, gbs: int) -> str:
    """What the output says of a global batch the user did not give ('' when given)."""
    if options.global_batch_size:
        return ""
    return (
        f"global batch {gbs} sequences: the default (NVIDIA's Llama 3 recipes' batch, the same on "
        "any number of GPUs), not given with --global-batch-size; the batch decides the plan "
        "(its micro-batches set the pipeline bubble): give yours"
    )


def probed_batches(options: PlanOptions, model: MemoryModel) -> PlanOptions:
    """The options with the micro-batch sizes a given memory model predicts: where some of its
    variants of the recompute granularities searched were probed at one micro-batch size only,
    which their fits hold as constants, the search keeps to that size (CaptureError when the
    sizes asked for exclude it, or two variants were probed alone at different sizes)."""
    space = options.space
    single = single_micro_batches(model, space.recompute)
    if not single:
        return options
    alone = " and ".join(
        f"its {' and '.join(names)} fit at micro-batch {m} only" for m, names in single.items()
    )
    asked = space.micro_batch_size
    (b, names), *more = single.items()
    fits = " and ".join(names)
    if more or (asked and b not in asked):
        sizes = ", ".join(map(str, asked))
        tail = (
            "so no micro-batch size is predicted for every plan"
            if more
            else f"so micro-batch {sizes} would be predicted as if it were {b}"
        )
        raise CaptureError(
            f"--memory-model: the memory model was probed with {alone}, {tail} (a fit probed at "
            "one size holds its activations as constants): profile the sizes you plan with (or "
            "drop --memory-model to profile on the spot)"
        )
    note = (
        f"micro-batch {b} only: the memory model's {fits} fit was probed at micro-batch {b} "
        "alone and predicts no other size (profile others, or drop --memory-model to profile "
        "on the spot)"
    )
    space = dataclasses.replace(space, micro_batch_size=(b,))
    return dataclasses.replace(options, space=space, notes=(*options.notes, note))


def searched_options(
    options: PlanOptions, cluster: Cluster, shape: ModelShape, model_kernels: str = ""
) -> PlanOptions:
    """The options a search runs with: on GPUs the free overlap flags on (--overlap-grad-reduce,
    in the plans' DdpOptions so that their gradient buckets are predicted, unless
    --ddp-num-buckets was given; --overlap-param-gather, which applies with the distributed
    optimizer: they hide data-parallel communication behind the backward / forward), and context
    parallelism searched only where the kernels run it (context_problem, latent_problem), and
    the optimizer offload fractions, activation offload sets and Megatron-FSDP twins the command
    line left open (plan.offload_space; activation offload where the kernel set of the memory
    model, `model_kernels` when it is given, runs it)."""
    space, cost = options.space, options.cost
    gpu = cluster.device != "cpu"
    if gpu and not space.ddp.optimizer.muon:  # Megatron-LM asserts Muon without them
        grad = space.ddp.ddp_num_buckets is None or space.ddp.overlap_grad_reduce
        run = dataclasses.replace(
            cost.settings, overlap_grad_reduce=grad, overlap_param_gather=True
        )
        cost = dataclasses.replace(cost, settings=run)
        ddp = dataclasses.replace(space.ddp, overlap_grad_reduce=grad)
        space = dataclasses.replace(space, ddp=ddp)
    kind = kernel_set("cuda" if gpu else "cpu", options.kernels)
    refused = context_problem((2,), space.cp_comm_type, kind, options.kernels) or (
        shape.mla.enabled and kind.startswith("gpu")
    )
    if not space.cp and refused:
        space = dataclasses.replace(space, cp=(1,))
    if not space.optimizer_offload:
        offload = searched_offload(space.ddp, options.objective, gpu, shape.dtype, options.kernels)
        space = dataclasses.replace(space, optimizer_offload=offload)
    if not space.fsdp:
        fsdp = searched_fsdp(space.ddp, options.objective, gpu, options.kernels)
        space = dataclasses.replace(space, fsdp=fsdp)
    if not space.activation_offload:
        runs = model_kernels or kind
        sets = activation_sets(shape, space.ddp, options.objective, runs, options.kernels)
        space = dataclasses.replace(
            space, activation_offload=((),) if options.no_activation_offload else sets
        )
    return dataclasses.replace(options, cost=cost, space=space)


def plan(
    shape: ModelShape,
    cluster: Cluster,
    options: PlanOptions = PlanOptions(),
    memory: MemoryModel | ModelSource | None = None,
) -> PlanResult:
    """Plan `shape` for `cluster` (or predict options.fixed); CaptureError when nothing fits."""
    if memory is None:
        raise CaptureError(
            "plan() needs a memory model or a source (capture_megatron.profile.memory_source)"
        )
    _refuse_flex(shape, options, cluster)
    shape = routed(shape, "planning")  # dropless MoE: plans fit at the forecast plus its margin
    supply = Supply(shape, memory)
    hw, margins = options.cost, options.margins(cluster, shape.hidden_size, *flex_backend(shape))
    if options.fixed is not None:
        model = supply.complete([options.fixed])
        fixed = evaluate_plan(model, shape, options.fixed, cluster, margins, hw)
        return _result(model, shape, cluster, options, (fixed,), 1, memory)
    if not cluster.gpu_memory_bytes:
        raise CaptureError("planning needs the usable memory per GPU: give --gpu-memory-gib")
    given = memory.kernels if isinstance(memory, MemoryModel) else ""
    options = searched_options(options, cluster, shape, given)
    if isinstance(memory, MemoryModel):
        options = probed_batches(options, memory)
    hw = options.cost
    gbs = global_batch(options, cluster)
    if not any(candidates(shape, cluster, gbs, options.space)):
        raise CaptureError(_why_no_candidate(shape, cluster, gbs, options.space))
    first = next(candidates(shape, cluster, gbs, options.space))
    supply.want(plans_explained(shape, options.space, first))  # plain DP, for the reasoning
    k = options.kernels
    low = (k.low_precision, k.low_precision_params)
    search_ = ClusterSearch(supply, shape, cluster, gbs, options.space, margins, hw, low)
    ranked, considered = search_.best(options.objective, options.top)
    if not ranked:  # every candidate's static bytes alone exceed the memory
        raise search_.no_fit(search_.run(cluster, "min-peak", 1)[0][0])
    if not ranked[0].fits:  # the error names the least any ranked plan needs
        raise search_.no_fit(min(ranked, key=lambda e: e.needed))
    explained = plans_explained(shape, options.space, ranked[0].plan)
    model = supply.complete([e.plan for e in ranked] + explained)
    return _result(model, shape, cluster, options, ranked, considered, memory)


def flex_backend(shape: ModelShape) -> tuple[str, int]:
    """The flex dispatcher's backend of `shape`'s MoE layers (hybridep or deepep, whose buffers
    a GPU holds outside the allocator; '' without flex) and DeepEP's SMs."""
    moe = shape.moe
    if not (moe.enabled and moe.moe_token_dispatcher_type == "flex"):
        return "", 0
    return moe.moe_flex_dispatcher_backend, moe.moe_deepep_num_sms


def _refuse_flex(shape: ModelShape, options: PlanOptions, cluster: Cluster) -> None:
    """CaptureError for what megatron-core or HybridEP refuses of a flex run (the rules of
    capture_megatron.features.dispatch; for a searched plan those of the plan-independent settings,
    the search keeps expert TP x EP > 1; on CPU processes the CPU kernel set's refusal)."""
    fixed, domain = options.fixed, options.cost.hardware.nvlink_domain
    group = fixed.ep * fixed.expert_tp if fixed is not None else 2
    cpu = cluster.device == "cpu"
    problems = flex_problems(shape.moe, shape.dtype, group, domain if fixed else group, cpu)
    if problems:
        raise CaptureError("; ".join(problems) + ".")


def _reach(shape: ModelShape, options: PlanOptions, model: MemoryModel) -> tuple[str, ...]:
    """min-peak's largest activation module set, for the reasoning's lowest reachable peak (see
    explain.Context.activation_reach)."""
    if options.objective != "min-peak" or options.no_activation_offload or not measured(model):
        return ()
    kernels = options.kernels
    return activation_sets(shape, options.space.ddp, "throughput", model.kernels, kernels)[-1]


def _result(
    model: MemoryModel,
    shape: ModelShape,
    cluster: Cluster,
    options: PlanOptions,
    ranked: tuple[Evaluated, ...],
    considered: int,
    memory: MemoryModel | ModelSource,
) -> PlanResult:
    """The PlanResult of plans evaluated at `shape`'s routing (the planning factor for dropless
    MoE): their peaks shown at the forecast, the chosen plan's routing report, baselines at the
    forecast, the reasoning and stock alternative at the planning factor."""
    cps = tuple(e.plan.cp for e in ranked)
    check_plans(
        shape, options.kernels, model.kernels, ranked[0].plan, cps, options.space.cp_comm_type
    )
    origin = ModelOrigin(model.device, model.kernels, model.versions)
    hw, margins = options.cost, options.margins(cluster, shape.hidden_size, *flex_backend(shape))
    space = options.space
    objective = "fixed" if options.fixed is not None else options.objective
    reach = _reach(shape, options, model)
    ctx = Context(model, shape, cluster, space, margins, hw, objective, reach)
    ranked, baselines = not_below_baselines(ctx, ranked, options.fixed is not None)
    shown = at_forecast(memory, shape, ranked, cluster, margins, hw)
    fore = routed(shape, "forecast")
    # dropless MoE: the baselines shown at the forecast, judged at the planning factor as the plans
    baselines = baselines_at_forecast(memory, shape, shown[0].plan, baselines, cluster, margins, hw)
    lines = reasoning(ctx, shown, considered) + trade(ctx, shown[0], baselines)
    if options.fixed is None:
        lines += tuple(x for x in (batch_line(options, ranked[0].plan.global_batch_size),) if x)
        lines += options.notes
    return PlanResult(
        fore,
        cluster,
        shown,
        considered,
        baselines,
        origin,
        options.kernels,
        reasoning=lines,
        stock_alternative=_shown(memory, shape, stock_alternative(ctx, ranked), ctx),
        margins=margins,
        routing=routing_report(memory, fore, ranked[0], shown[0], cluster, margins, hw),
        cost=options.cost,
        recompute_modules=space.recompute_modules,
    )


def _shown(
    memory: MemoryModel | ModelSource, shape: ModelShape, e: Evaluated | None, ctx: Context
) -> Evaluated | None:
    """A plan evaluated at the planning factor, with its peaks at the forecast (None stays)."""
    if e is None:
        return None
    return at_forecast(memory, shape, (e,), ctx.cluster, ctx.margins, ctx.hw)[0]


def _why_no_candidate(shape: ModelShape, cluster: Cluster, gbs: int, space: Space) -> str:
    tps = [t for t in space.tp if not tp_head_problems(shape.num_attention_heads, shape.groups, t)]
    parts = [
        f"no parallel plan of {shape.num_layers} layers fits {cluster.gpus} GPUs with global "
        f"batch {gbs}"
    ]
    if not tps:
        parts.append(
            f"heads {shape.num_attention_heads} / query groups {shape.groups} divide by none of "
            f"TP {list(space.tp)}"
        )
    if space.pp and min(space.pp) > shape.num_layers:
        parts.append(f"layers {shape.num_layers} < PP {min(space.pp)}")
    if shape.moe.enabled and space.ep:
        parts.append(
            f"EP {list(space.ep)} x expert TP (= TP) must divide the TP x CP x DP ranks of a "
            f"stage, and EP the {shape.moe.num_experts} experts"
        )
    if any(c > 1 for c in space.cp):
        parts.append(f"CP {list(space.cp)} must divide the GPUs and the sequence into 2 x CP parts")
    parts.append(
        "check --global-batch-size is a multiple of micro-batch x DP and TP divides the GPUs"
    )
    return "; ".join(parts)
