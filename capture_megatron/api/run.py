"""predict() and plan(): the public Python API, what the command line and the benchmarks call.

Both take a Megatron-LM command line (a list of flags, exactly as `capture-megatron predict` /
`plan` take it) or a Request (typed objects), and return a PlanResult: the chosen (or given) plan,
every pipeline rank's forecast, the baselines, the reasons, the step-time estimate, and
`to_json()` / `write(path)` for the plan JSON. The support rules (capture_megatron.rules) run once
per request, before anything is profiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from capture_megatron.api import kept
from capture_megatron.api.args import plan_parser, predict_parser
from capture_megatron.api.request import Request, cluster_of, read_request
from capture_megatron.config.kernels import kernel_set
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, ModelSource, read_model
from capture_megatron.fit.io import check_fitted
from capture_megatron.flags import parser as flags
from capture_megatron.forecast.cuda_graphs import graphs_note
from capture_megatron.forecast.fsdp import moments_note
from capture_megatron.forecast.layers import micro_batch_problem
from capture_megatron.planner import PlanResult, model_notes
from capture_megatron.planner import plan as plan_stage
from capture_megatron.planner.limits import too_large
from capture_megatron.planner.notes import offload_note
from capture_megatron.planner.run import global_batch
from capture_megatron.rules import check_request
from capture_megatron.version import __version__

Memory = MemoryModel | ModelSource
"""A fitted memory model, or a source asked for exactly the (variant, probe shape) pairs the
candidate plans need (capture_megatron.profile.memory_source profiles them on demand)."""


def predict(
    request: Request | Sequence[str],
    *,
    gpus: int | None = None,
    device: str | None = None,
    memory: Memory | None = None,
    progress: bool = False,
) -> PlanResult:
    """Every pipeline rank's peak memory for exactly the run a Megatron-LM command line
    describes: Megatron's own split (or the layout / first-last / account-for-embedding-loss flags
    given), its recompute, precision, kernels and parallel sizes, with Megatron-LM's defaults
    where a flag is absent.

    request: the pretrain_gpt.py flags verbatim, e.g. ``["--num-layers", "32", ...,
        "--tensor-model-parallel-size", "2"]``, with ``--gpus`` (or the `gpus` argument) and
        optionally ``--gpu-memory-gib`` (whether it fits), ``--device``, ``--memory-model``; or a
        Request whose options.fixed is the plan to predict.
    gpus, device: appended to the flags as --gpus / --device (flags lists only).
    memory: a MemoryModel or ModelSource to predict with instead of --memory-model or profiling
        on the spot (cached under $CAPTURE_MEGATRON_CACHE).
    progress: show progress bars while profiling.

    Returns a PlanResult: ``result.best.rank_peaks`` (bytes per pipeline rank, the maximum over
    its TP / DP peers), ``result.best.stages`` (each rank's breakdown), ``result.to_json()``.
    Raises CaptureError (one paragraph naming the offending values) for what cannot be read, is
    not modelled, or that megatron-core refuses; flags that cannot change memory are accepted and
    listed in ``result.ignored_flags``."""
    if not isinstance(request, Request):
        request = _from_flags(request, False, gpus, device)
    elif request.options.fixed is None:
        raise CaptureError("predict() needs a plan to predict: set Request.options.fixed")
    return forecast(request, memory, progress)


def plan(
    request: Request | Sequence[str],
    *,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
    device: str | None = None,
    memory: Memory | None = None,
    progress: bool = False,
) -> PlanResult:
    """The best plan for a model on a cluster: TP / PP / DP / VPP / EP / CP sizes, micro-batch,
    recompute (per stage), offload and the pipeline layout -- by default the fastest estimated
    step that fits every rank's forecast under the GPU memory (--objective throughput), else the
    lowest worst-rank peak (min-peak, CAPTURE's split) or the fewest GPUs (min-gpus).

    request: a Megatron-LM command line (flags list; sizes it gives are fixed, the rest
        searched; with --pipeline-model-parallel-layout the plan is only predicted), with
        ``--gpus`` and ``--gpu-memory-gib`` (or the arguments of those names); or a Request.
    gpus, gpu_memory_gib, device: appended to the flags (flags lists only).
    memory, progress: as for predict().

    Returns a PlanResult: ``result.best.plan`` (a ParallelPlan; ``.layout`` is Megatron's
    --pipeline-model-parallel-layout), ``result.megatron_args()`` (the flags that run it),
    ``result.ranked`` (the plans shown), ``result.baselines``, ``result.reasoning``,
    ``result.step`` (the estimated step, throughput, MFU), ``result.to_json()``. Raises
    CaptureError as predict() does, and when no plan fits (naming the smallest setup that
    would)."""
    if not isinstance(request, Request):
        extra = ("--gpu-memory-gib", str(gpu_memory_gib)) if gpu_memory_gib is not None else ()
        request = _from_flags((*request, *extra), True, gpus, device)
    return forecast(request, memory, progress)


def _from_flags(
    argv: Sequence[str], searched: bool, gpus: int | None, device: str | None
) -> Request:
    """The Request a flags list describes (`searched`: plan, else predict)."""
    argv = [*argv, *(("--gpus", str(gpus)) if gpus is not None else ())]
    argv += ("--device", device) if device is not None else ()
    for output in ("--json", "--png"):
        if output in argv:
            raise CaptureError(
                f"{output}: the API returns the result and writes nothing; call "
                "result.write(path) for the plan JSON (the command line writes --json and --png)"
            )
    ns = flags.parse_flags((plan_parser if searched else predict_parser)(), list(argv))
    return read_request(ns, cluster_of(ns, need_memory=searched), fixed_plan=not searched)


def forecast(request: Request, memory: Memory | None = None, progress: bool = False) -> PlanResult:
    """Plan (or, with request.options.fixed, predict) a Request: the support rules once, then the
    memory model (given, read from request.memory_model, or profiled on the spot), then the
    planner; the result carries the request's ignored flags and the notes on how it was read."""
    shape, cluster, options = request.shape, request.cluster, request.options
    gbs = global_batch(options, cluster)
    # searched micro-batches: powers of two dividing the batch (planner.space.micro_batch_sizes)
    too_large(shape, cluster, gbs, max(options.space.micro_batch_size, default=gbs & -gbs))
    space = options.space
    device = "" if request.memory_model else _device(request)  # a model's own: planner checks
    kind = kernel_set(device, options.kernels) if device else ""
    check_request(
        shape, options.kernels, space.ddp, space.cp, space.cp_comm_type, options.fixed, kind
    )
    keeping = memory is None and not request.memory_model and kept.enabled()
    found = kept.read_back(kept.key_of(request, device, kind)) if keeping else None
    if found is None:
        memory = memory_of(request, progress) if memory is None else memory
        if options.fixed and request.memory_model and isinstance(memory, MemoryModel):
            problem = micro_batch_problem(memory, shape, options.fixed)
            if problem:
                raise CaptureError(f"--memory-model {request.memory_model}: {problem}.")
        found = plan_stage(shape, cluster, options, memory)
        if keeping:  # the key as the records now are: those this answer was worked out from
            kept.keep(kept.key_of(request, device, kind), found)
    return dataclasses.replace(
        found, ignored_flags=request.ignored_flags, notes=_notes(request, found)
    )


def _device(request: Request) -> str:
    """The device the memory model profiled on the spot profiles on."""
    from capture_megatron.profile import default_device

    return default_device(request.device)


def memory_of(request: Request, progress: bool) -> Memory:
    """The memory model from request.memory_model, or a source that profiles on the spot."""
    if request.memory_model:
        model = read_model(request.memory_model)
        check_fitted(model, request.shape, request.memory_model, __version__)
        return model
    from capture_megatron.profile import memory_source

    return memory_source(request.shape, request.device, progress, request.options.kernels)


def _notes(request: Request, result: PlanResult) -> tuple[str, ...]:
    """What the output says besides the reasoning: how the model was read, what stock
    Megatron-LM cannot build of it, the routing forecast, a sequence parallelism turned off at
    TP 1, the flex dispatcher's buffers, the CUDA graphs' static inputs, Megatron-FSDP's whole Adam
    moments under Transformer Engine 2.10 / 2.11, and what optimizer
    offloading saves and costs."""
    space = request.options.space
    sp_given = space.sequence_parallel == (True,)
    sp_note = (
        "--sequence-parallel is off at TP 1, as Megatron-LM turns it off"
        if sp_given and result.best.plan.tp == 1
        else ""
    )
    routing = result.routing.notes() if result.routing else ()
    flex = result.margins.flex_note(result.shape, result.best.plan)
    graphs = graphs_note(result.shape, result.best.plan)
    moments = moments_note(result.best.plan, result.on_gpu)
    offload = offload_note(result, space.ddp.optimizer_cpu_offload)
    per, best = space.layers_per_virtual_stage, result.best.plan
    vpp_note = (
        f"--num-layers-per-virtual-pipeline-stage {per}: VPP {best.vpp} ({request.shape.num_layers}"
        f" layers over PP {best.pp}, {per} per virtual stage), the layers placed by the planner "
        "(megatron_args give them as the layout)"
        if per and request.options.fixed is None
        else ""
    )
    extra = tuple(n for n in (sp_note, vpp_note, flex, graphs, moments, offload) if n)
    return (*request.model_notes, *model_notes(request.shape), *routing, *extra)
