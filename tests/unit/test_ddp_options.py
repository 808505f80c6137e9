"""DdpOptions (issue 26): Megatron-LM's rules for the gradient buffers' dtype and what megatron-core
refuses, and the round trip flags -> objects -> megatron_args -> flags that lets a plan run as
predicted."""

from __future__ import annotations

import pytest

from capture_megatron.config import DdpOptions, ModelShape, ParallelFlags, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.flags import parser as flags
from capture_megatron.flags.resolve import parallel_plan
from capture_megatron.planner import plan_args
from capture_megatron.train.entry import build_parser


@pytest.mark.parametrize(
    ("dtype", "fields", "grads"),
    [
        ("bf16", {}, "fp32"),  # Megatron-LM turns accumulate_allreduce_grads_in_fp32 on
        ("bf16", dict(grad_reduce_in_bf16=True), "bf16"),
        ("bf16", dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16"), "bf16"),
        ("bf16", dict(accumulate_allreduce_grads_in_fp32=True), "fp32"),
        ("fp16", {}, "fp16"),  # the flag is off by default and only set for bf16
        ("fp16", dict(accumulate_allreduce_grads_in_fp32=True), "fp32"),
        ("fp16", dict(grad_reduce_in_bf16=True), "fp16"),  # a bf16-only flag
        ("fp32", dict(grad_reduce_in_bf16=True), "fp32"),
    ],
)
def test_gradient_dtype_follows_megatron_lm(dtype, fields, grads):
    assert DdpOptions(**fields).grad_dtype(dtype) == grads


def test_megatron_core_refusals_are_named():
    with pytest.raises(CaptureError, match="--exp-avg-dtype bf16 needs --use-precision-aware"):
        DdpOptions(exp_avg_dtype="bf16")
    with pytest.raises(CaptureError, match="both --ddp-num-buckets and --ddp-bucket-size"):
        DdpOptions(ddp_bucket_size=10, ddp_num_buckets=2)
    base = dict(tp=1, pp=1, dp=6, micro_batch_size=1, global_batch_size=6, layers_per_stage=(2,))
    with pytest.raises(CaptureError, match="needs --use-distributed-optimizer"):
        ParallelPlan(**base, ddp=DdpOptions(use_precision_aware_optimizer=True))
    with pytest.raises(CaptureError, match="does not divide the 6"):
        four = DdpOptions(num_distributed_optimizer_instances=4)
        ParallelPlan(**base, distributed_optimizer=True, ddp=four)


def test_a_plans_flags_give_back_the_same_plan():
    shape = ModelShape(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512,
        dtype="bf16",
    )  # fmt: skip
    ddp = DdpOptions(
        overlap_grad_reduce=True,
        grad_reduce_in_bf16=True,
        use_precision_aware_optimizer=True,
        exp_avg_dtype="fp8",
        main_params_dtype="fp16",
        num_distributed_optimizer_instances=2,
        ddp_bucket_size=123456,
        ddp_pad_buckets_for_high_nccl_busbw=True,
        defer_embedding_wgrad_compute=True,
        wgrad_deferral_limit=4,
    )
    plan = parallel_plan(
        ParallelFlags(pipeline_model_parallel_size=2, use_distributed_optimizer=True),
        shape,
        8,
        ddp,
    )
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
    argv += ["--seq-length", "32", "--vocab-size", "512", "--bf16", "--mock-data"]
    ns = flags.parse_flags(build_parser(), [*argv, *plan_args(plan)])
    read = flags.from_namespace(DdpOptions, ns)
    assert read == ddp
    assert parallel_plan(flags.from_namespace(ParallelFlags, ns), shape, 8, read) == plan
    assert ParallelPlan.from_json(plan.to_json()) == plan
