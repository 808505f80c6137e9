"""Issue 28, item 5: plans run as predicted. For generated models, clusters, devices and flags
given, the plan's model flags plus its megatron_args, parsed by the trainer (`capture-megatron
train` / pretrain_gpt's parser), give back the same model, the same parallel plan (sizes, batch,
layout, recompute), the kernels the plan was predicted with (the local spec for a CPU plan: the
CPU kernel set) and the overlap flags its estimate assumed. Synthetic memory model: planning logic
only, no profiling; seeded, so a failure reproduces."""

from __future__ import annotations

import dataclasses
import random

import pytest
from synthetic_memory import synthetic_source

from capture_megatron.config import GIB, Cluster, Kernels, ModelShape, ParallelFlags
from capture_megatron.config.ddp import ActivationOffload, DdpOptions
from capture_megatron.errors import CaptureError
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.fields import flagged_fields
from capture_megatron.flags.resolve import parallel_plan
from capture_megatron.planner import PlanOptions, plan, space_from
from capture_megatron.planner.emit import model_args, parallel_flags, plan_args
from capture_megatron.train.entry import parse_config

DEVICES = ("cpu", "cuda")
"""A CPU plan (the CPU kernel set) and a GPU plan (the GPU kernel set; fake-cuda and cuda plan
alike)."""

DECLARED = {
    spec.name
    for cls in (ParallelFlags, DdpOptions, ActivationOffload, Fsdp)
    for _, spec in flagged_fields(cls)
} | {"--ckpt-format"}
"""Every flag the fields of the plan's types declare (plan_args writes no other), and the
checkpoint format Megatron-LM requires of Megatron-FSDP."""


def _shape(rng: random.Random) -> ModelShape:
    heads = rng.choice((4, 8, 16))
    return ModelShape(
        num_layers=rng.choice((4, 6, 8, 12, 16)),
        hidden_size=heads * rng.choice((32, 64)),
        num_attention_heads=heads,
        num_query_groups=rng.choice((0, heads // 2)),  # 0: no GQA, as the flags say it
        seq_length=rng.choice((256, 512, 8192)),
        max_position_embeddings=8192,
        vocab_size=rng.choice((1000, 32000)),
        swiglu=rng.random() < 0.5,
        normalization=rng.choice(("LayerNorm", "RMSNorm")),
        position_embedding_type=rng.choice(("learned_absolute", "rope")),
        untie_embeddings_and_output_weights=rng.random() < 0.5,
        dtype="bf16",
    )


def _given(rng: random.Random) -> ParallelFlags:
    """Flags a user may fix (each sometimes)."""
    fixed: dict = {}
    if rng.random() < 0.3:
        fixed["recompute_granularity"] = rng.choice(("full", "selective"))
    if rng.random() < 0.3:
        fixed["micro_batch_size"] = rng.choice((1, 2))
    if rng.random() < 0.3:
        fixed["use_distributed_optimizer"] = True
    return ParallelFlags(**fixed)


def cpu_source(needs):
    """The synthetic fits as a CPU memory model (the CPU kernel set a `--device cpu` plan uses)."""
    return dataclasses.replace(synthetic_source(needs), device="cpu", kernels="cpu")


def _case(seed: int):
    rng = random.Random(seed)
    device = DEVICES[seed % 2]
    shape = _shape(rng)
    gpus = rng.choice((1, 2, 4, 8, 16))
    cluster = Cluster(gpus=gpus, gpu_memory_bytes=int(rng.choice((2, 8, 80)) * GIB), device=device)
    options = PlanOptions(
        objective=rng.choice(("throughput", "min-peak", "min-gpus")),
        space=space_from(_given(rng)),
        global_batch_size=rng.choice((0, 16, 64)),
        context_gib=0,
        kernels=Kernels(transformer_impl=rng.choice(("transformer_engine", "auto"))),
    )
    return shape, cluster, options


@pytest.mark.parametrize("seed", range(24))
def test_flags_parse_back_to_the_plan(seed):
    shape, cluster, options = _case(seed)
    try:
        source = cpu_source if cluster.device == "cpu" else synthetic_source
        result = plan(shape, cluster, options, source)
    except Exception as err:  # nothing fits or no candidate: a refusal, not a plan
        assert type(err).__name__ == "CaptureError", err
        pytest.skip(f"no plan: {err}")
    best = result.best.plan
    # one type: the plan's flags are ParallelFlags' fields written by their declared flags ...
    flags = parallel_flags(best)
    assert parallel_plan(flags, shape, best.world_size, best.ddp) == best
    written = {a for a in plan_args(best) if a.startswith("--")}
    assert written <= DECLARED, written - DECLARED
    # ... and the whole command line, parsed as the trainer parses it, gives the plan back
    argv = [*model_args(shape), *result.megatron_args(), "--mock-data"]
    if best.ddp.fsdp.enabled:  # a GPU plan for Megatron-LM, which the CPU trainer refuses ...
        with pytest.raises(CaptureError, match="--use-megatron-fsdp"):
            parse_config(argv, best.world_size)
        zero3 = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params")
        argv = [a for a in argv if a not in (*zero3, "--ckpt-format", "fsdp_dtensor")]
        best = dataclasses.replace(best, ddp=dataclasses.replace(best.ddp, fsdp=Fsdp()))
    cfg = parse_config(argv, best.world_size)
    assert cfg.shape == shape
    assert cfg.plan == best
    if cluster.device == "cpu":
        assert cfg.kernels.transformer_impl == "local"
        assert not cfg.plan.ddp.overlap_grad_reduce and not cfg.run.overlap_param_gather
    else:
        assert cfg.kernels == result.kernels.for_gpu()
        settings = result.cost.settings
        dp = best.dp * best.cp > 1
        # in the plan's DDP settings (its gradient buckets predicted), on any DP
        assert cfg.plan.ddp.overlap_grad_reduce == settings.overlap_grad_reduce
        expected = settings.overlap_param_gather and dp and best.distributed_optimizer
        assert cfg.run.overlap_param_gather == expected


def test_cpu_plan_names_the_local_spec():
    """The issue's case: `plan --device cpu` wrote --transformer-impl transformer_engine, which
    `train` on CPU refuses."""
    shape, _, _ = _case(0)
    cluster = Cluster(gpus=2, gpu_memory_bytes=8 * GIB, device="cpu")
    result = plan(shape, cluster, PlanOptions(global_batch_size=8), cpu_source)
    args = result.megatron_args()
    assert args[args.index("--transformer-impl") + 1] == "local"
    assert "transformer_engine" not in args
