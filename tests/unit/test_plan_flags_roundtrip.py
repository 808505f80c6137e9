"""Issue 30, must-show 3 (issue 28, Build 5): plan -> megatron_args -> parse -> the same plan, for
generated plans. For generated valid models and ParallelPlans (TP, PP, DP, VPP, CP, EP and expert
TP, micro-batch and batch, the pipeline layout, recompute, sequence parallelism, the distributed
optimizer, the DDP options), on a CPU and a GPU kernel set, the model flags plus what a plan JSON
holds as `megatron_args` (plan.emit.run_args, what PlanResult.megatron_args writes), parsed by the
parser `capture-megatron predict` takes a pasted Megatron-LM line with (its build_parser, then
resolve_shape and plan_options(fixed_plan=True), as cli/plan.plan_and_report), give back the same
ModelShape, the same ParallelPlan and the kernel set. A seeded random generator (hypothesis is not
a dependency): a failure names its seed and reproduces. Pure flag logic: no profiling."""

from __future__ import annotations

import random

import pytest

from capture_megatron.api.request import cluster_of, plan_options, resolve_shape
from capture_megatron.cli import predict
from capture_megatron.config import DdpOptions, Kernels, ModelShape, ParallelPlan, Recompute
from capture_megatron.errors import CaptureError
from capture_megatron.features.moe import Experts
from capture_megatron.features.recompute import RECOMPUTE_MODULES
from capture_megatron.flags import megatron_lm
from capture_megatron.flags import parser as flags
from capture_megatron.planner.emit import model_args, run_args
from capture_megatron.rules.megatron import check_plan_fits_model
from capture_megatron.steptime.settings import StepSettings

DEVICES = ("cpu", "fake-cuda")
"""A CPU plan (the CPU kernel set, no overlap flags) and a GPU plan (the GPU kernel set)."""
SEEDS = range(160)
"""Generated cases: half on each device."""


def _shape(rng: random.Random) -> ModelShape:
    heads = rng.choice((8, 16, 32))
    groups = rng.choice((heads, heads // 2, heads // 8))
    moe = rng.random() < 0.3
    experts = Experts(num_experts=rng.choice((4, 8)), moe_ffn_hidden_size=256) if moe else Experts()
    return ModelShape(
        num_layers=rng.choice((4, 6, 8, 12, 16)),
        hidden_size=heads * 64,
        num_attention_heads=heads,
        num_query_groups=0 if groups == heads else groups,
        seq_length=rng.choice((512, 2048, 8192)),
        max_position_embeddings=8192,
        vocab_size=rng.choice((1000, 32000, 50257)),
        swiglu=rng.random() < 0.5,
        normalization=rng.choice(("LayerNorm", "RMSNorm")),
        position_embedding_type=rng.choice(("learned_absolute", "rope")),
        untie_embeddings_and_output_weights=rng.random() < 0.5,
        add_bias_linear=rng.random() < 0.5,
        dtype=rng.choice(("bf16", "fp16", "fp32")),
        moe=experts,
        mtp_num_layers=rng.choice((0, 0, 0, 1)),
    )


def _split(rng: random.Random, layers: int, parts: int) -> tuple[int, ...]:
    """`layers` over `parts` virtual stages, every stage at least one layer (zeros sometimes)."""
    floor = 0 if rng.random() < 0.2 else 1
    counts = [floor] * parts
    for _ in range(layers - floor * parts):
        counts[rng.randrange(parts)] += 1
    return tuple(counts)


def _recompute(rng: random.Random, plan: ParallelPlan) -> Recompute:
    kind = rng.choice(("none", "selective", "block", "uniform"))
    if kind == "selective":
        return Recompute.selective(tuple(rng.sample(RECOMPUTE_MODULES, rng.choice((0, 1)))))
    if kind == "block":  # n per stage up to its largest chunk (every larger n is the same run)
        counts = (rng.randint(0, max(plan.chunks_of(r))) for r in range(plan.pp))
        return Recompute("full", "block", tuple(counts))
    if kind == "uniform":
        return Recompute("full", "uniform", (1,) * plan.pp)
    return Recompute()


def _ddp(rng: random.Random, dtype: str, distributed: bool, gpu: bool, pp: int) -> DdpOptions:
    buckets = rng.choice(({}, {"ddp_bucket_size": 10_000_000}, {"ddp_num_buckets": 4}))
    aware = distributed and dtype == "bf16" and rng.random() < 0.3
    # issue 31: the optimizer offload the planner chooses (precision-aware at fp32 dtypes)
    offload = rng.choice((0.0, 0.0, 0.25, 0.5, 1.0)) if aware else 0.0
    return DdpOptions(
        overlap_grad_reduce=gpu and rng.random() < 0.7,
        grad_reduce_in_bf16=dtype == "bf16" and rng.random() < 0.3,
        use_precision_aware_optimizer=aware,
        exp_avg_dtype="bf16" if aware and not offload else "fp32",
        optimizer_cpu_offload=offload > 0,
        optimizer_offload_fraction=offload or 1.0,
        num_distributed_optimizer_instances=2 if distributed and rng.random() < 0.2 else 1,
        ddp_pad_buckets_for_high_nccl_busbw=rng.random() < 0.2,
        defer_embedding_wgrad_compute=pp > 1 and rng.random() < 0.2,
        **buckets,
    )


def _plan(rng: random.Random, shape: ModelShape, gpu: bool) -> ParallelPlan:
    """A random plan (possibly one the model cannot run: the caller draws again)."""
    tp = rng.choice((1, 2, 4, 8))
    pp = rng.choice((1, 2, 4))
    vpp = rng.choice((1, 2)) if pp > 1 else 1
    dp, cp = rng.choice((1, 2, 4)), rng.choice((1, 2)) if gpu else 1
    mbs = rng.choice((1, 2, 4))
    moe = shape.moe.enabled
    ep = rng.choice((1, 2, 4)) if moe else 1
    distributed = rng.random() < 0.5
    plan = ParallelPlan(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        vpp=vpp,
        ep=ep,
        etp=rng.choice((0, 1)) if ep > 1 else 0,
        micro_batch_size=mbs,
        global_batch_size=mbs * dp * rng.choice((1, 4, 8)),
        layers_per_stage=_split(rng, shape.num_layers, pp * vpp),
        sequence_parallel=tp > 1 and (moe or rng.random() < 0.5),
        distributed_optimizer=distributed,
        microbatch_group_size=rng.choice((0, pp)) if vpp > 1 else 0,
        cp_comm_type=rng.choice(("", "p2p", "a2a")) if cp > 1 else "",
        mtp_layers=shape.mtp_num_layers,
        ddp=_ddp(rng, shape.dtype, distributed, gpu, pp),
    )
    return plan.replace(recompute=_recompute(rng, plan))


def _case(seed: int) -> tuple[ModelShape, ParallelPlan, str, Kernels]:
    """A model, a plan it runs, the device and the kernels, drawn until valid."""
    rng = random.Random(seed)
    device = DEVICES[seed % 2]
    gpu = device != "cpu"
    for _ in range(1000):
        try:
            shape = _shape(rng)
            plan = _plan(rng, shape, gpu)
            check_plan_fits_model(shape, plan)
        except CaptureError:
            continue
        impl = rng.choice(("transformer_engine", "auto", "local")) if gpu else "local"
        backend = rng.choice(("auto", "flash", "fused", "unfused")) if gpu else "auto"
        return shape, plan, device, Kernels(transformer_impl=impl, attention_backend=backend)
    raise AssertionError(f"seed {seed}: no valid plan drawn")


def emitted(shape: ModelShape, plan: ParallelPlan, device: str, kernels: Kernels) -> list[str]:
    """The model flags and the plan JSON's megatron_args of `plan` (GPU: the overlap flags a
    search turns on, the plan's DdpOptions holding --overlap-grad-reduce as planner.searched_options
    sets it)."""
    gpu = device != "cpu"
    settings = (
        StepSettings(plan.ddp.overlap_grad_reduce, overlap_param_gather=True) if gpu else None
    )
    return model_args(shape) + run_args(plan, kernels, gpu, settings)


@pytest.mark.parametrize("seed", SEEDS)
def test_megatron_args_parse_back_to_the_plan(seed):
    shape, plan, device, kernels = _case(seed)
    argv = emitted(shape, plan, device, kernels)
    cluster_argv = ["--gpus", str(plan.world_size), "--device", device]
    ns = flags.parse_flags(predict.build_parser(), [*argv, *cluster_argv])
    megatron_lm.check(ns)  # Megatron-LM-only flags emitted (--overlap-param-gather) are accepted
    parsed_shape, _ = resolve_shape(ns)
    assert parsed_shape == shape, (seed, argv)
    options = plan_options(ns, parsed_shape, cluster_of(ns), device, fixed_plan=True)
    assert options.fixed == plan, (seed, argv)
    parsed_kernels = flags.from_namespace(Kernels, ns)
    if device == "cpu":
        assert parsed_kernels == Kernels(transformer_impl="local"), argv
    else:
        assert parsed_kernels == kernels.for_gpu(), argv


def test_the_generator_covers_every_setting():
    """The cases reach every setting the round trip is about (a generator that never draws one
    would pass vacuously)."""
    cases = [_case(s) for s in SEEDS]
    plans = [p for _, p, _, _ in cases]
    assert {p.tp for p in plans} >= {1, 2, 4, 8}
    assert {p.pp for p in plans} >= {1, 2, 4} and {p.vpp for p in plans} == {1, 2}
    assert {p.cp for p in plans} == {1, 2} and {p.ep for p in plans} >= {1, 2, 4}
    assert {p.etp for p in plans} == {0, 1} and {p.micro_batch_size for p in plans} == {1, 2, 4}
    assert {p.recompute.granularity for p in plans} == {"none", "selective", "full"}
    assert {p.recompute.method for p in plans if p.recompute.granularity == "full"} == {
        "block",
        "uniform",
    }
    assert {p.distributed_optimizer for p in plans} == {False, True}
    assert {p.sequence_parallel for p in plans} == {False, True}
    assert any(0 in p.layers_per_stage for p in plans) and any(p.mtp_layers for p in plans)
    assert any(p.microbatch_group_size for p in plans) and any(p.cp_comm_type for p in plans)
    assert {p.ddp.overlap_grad_reduce for p in plans} == {False, True}
    assert any(p.ddp.use_precision_aware_optimizer for p in plans)
    assert any(p.ddp.ddp_num_buckets for p in plans) and any(p.ddp.ddp_bucket_size for p in plans)
    assert any(p.ddp.num_distributed_optimizer_instances > 1 for p in plans)
    assert any(p.ddp.defer_embedding_wgrad_compute for p in plans)
    fractions = {p.ddp.optimizer_offload_fraction for p in plans if p.ddp.optimizer_cpu_offload}
    assert fractions == {0.25, 0.5, 1.0}


def test_a_block_count_above_a_stage_is_the_layers_it_holds():
    """The mismatch the round trip found: a plan recomputing every layer of stages of 2 and 3
    layers is emitted as `--recompute-num-layers 3` (stock Megatron-LM's flag), which parsed to
    (3, 3); Megatron's block method recomputes min(n, k) of a chunk of k, so it is (2, 3)."""
    model = ["--num-layers", "5", "--hidden-size", "64", "--num-attention-heads", "4"]
    model += ["--seq-length", "128", "--vocab-size", "512"]
    run = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|tttL"]
    run += ["--recompute-granularity", "full", "--recompute-method", "block"]
    ns = flags.parse_flags(
        predict.build_parser(),
        [*model, *run, "--recompute-num-layers", "4", "--gpus", "2", "--device", "cpu"],
    )
    shape, _ = resolve_shape(ns)
    fixed = plan_options(ns, shape, cluster_of(ns), "cpu", fixed_plan=True).fixed
    assert fixed is not None and fixed.recompute.num_layers == (2, 3)
    emitted = run_args(fixed, Kernels(), False)
    assert emitted[emitted.index("--recompute-num-layers") + 1] == "3"
