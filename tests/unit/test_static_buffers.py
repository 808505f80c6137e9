"""The static bytes of every gradient / optimizer-state setting equal megatron-core's own: a real
GPTModel chunk wrapped in megatron-core's DDP with its optimizer (megatron/training.py, as training
builds them), stepped once, is rank 0 of a DP job of torch's fake process group; its
parameter buffer, gradient buffers and optimizer state (Adam's, or the precision-aware optimizer's
states and scales) are walked and compared byte for byte with predict.static.chunk_static."""

from __future__ import annotations

import pytest

from capture_megatron.config import (
    BuildOptions,
    DdpOptions,
    ModelShape,
    OptimOptions,
    ParallelPlan,
    RunOptions,
)
from capture_megatron.emulate import cpu_compat
from capture_megatron.forecast.static import chunk_static
from capture_megatron.megatron.backend import Backend
from capture_megatron.megatron.builder import build_gpt, transformer_config
from capture_megatron.megatron.training import make_optimizer, wrap_model
from capture_megatron.profile.groups import fake_job
from capture_megatron.profile.held import static_bytes

pytestmark = pytest.mark.slow

SHAPE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=500,
)
PA = dict(use_precision_aware_optimizer=True)
CASES = [
    # (dtype, DP, distributed optimizer, DdpOptions fields)
    ("bf16", 2, True, {}),
    ("bf16", 2, True, dict(grad_reduce_in_bf16=True)),
    ("bf16", 1, False, dict(grad_reduce_in_bf16=True)),
    ("fp16", 2, True, {}),
    ("fp16", 2, True, dict(accumulate_allreduce_grads_in_fp32=True)),
    ("fp16", 1, False, dict(accumulate_allreduce_grads_in_fp32=True)),
    ("fp32", 2, True, {}),
    ("bf16", 2, True, PA),
    ("bf16", 2, True, dict(PA, main_grads_dtype="bf16", exp_avg_dtype="bf16")),
    ("bf16", 2, True, dict(PA, main_params_dtype="fp16", exp_avg_sq_dtype="fp16")),
    ("bf16", 4, True, dict(PA, exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16")),
    ("fp16", 2, True, dict(PA, exp_avg_dtype="fp16", accumulate_allreduce_grads_in_fp32=True)),
    ("fp32", 2, True, dict(PA, exp_avg_dtype="bf16")),
    ("bf16", 4, True, dict(num_distributed_optimizer_instances=2)),
    ("bf16", 8, True, dict(PA, num_distributed_optimizer_instances=4, exp_avg_dtype="bf16")),
    ("bf16", 2, True, dict(overlap_grad_reduce=True, ddp_bucket_size=20000)),
    ("bf16", 4, True, dict(overlap_grad_reduce=True, ddp_num_buckets=3)),
    ("bf16", 2, True, dict(ddp_pad_buckets_for_high_nccl_busbw=True)),
    (
        "bf16",
        2,
        True,
        dict(
            overlap_grad_reduce=True,
            ddp_bucket_size=30000,
            ddp_pad_buckets_for_high_nccl_busbw=True,
            num_distributed_optimizer_instances=2,
        ),
    ),
]


def _scales(optimizer) -> int:
    """Bytes of the precision-aware optimizer's per-state scales (kept beside its state)."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return sum(
        t.nbytes for o in inner for per in getattr(o, "_scales", {}).values() for t in per.values()
    )


@pytest.mark.parametrize(("dtype", "dp", "distopt", "fields"), CASES, ids=str)
def test_static_bytes_equal_megatron_cores(dtype, dp, distopt, fields):
    cpu_compat.apply("cpu")
    ddp = DdpOptions(**fields)
    shape = ModelShape(**SHAPE, dtype=dtype)
    plan = ParallelPlan(
        tp=1,
        pp=1,
        dp=dp,
        micro_batch_size=1,
        global_batch_size=dp,
        layers_per_stage=(2,),
        distributed_optimizer=distopt,
        ddp=ddp,
    )
    with fake_job(1, dp, instances=ddp.num_distributed_optimizer_instances):
        config = transformer_config(shape, plan, 0, BuildOptions())
        gpt = build_gpt(shape, plan, config, Backend(), 2, True, True, None)
        model = wrap_model([gpt], shape, plan, RunOptions(), check_for_nan_in_grad=False)
        optimizer, _ = make_optimizer(
            model, shape, plan, OptimOptions(), 1, use_gloo_process_groups=False
        )
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        assert optimizer.step()[0]  # creates the optimizer state
        params, grads, state = static_bytes(model[0], optimizer)
        numels = [p.numel() for p in model[0].parameters()]
        buckets = [len(b.buckets) for b in model[0].buffers]
        measured = (params, grads, state + _scales(optimizer))
        del model, optimizer, gpt
    bucket = ddp.bucket_size(dp, sum(numels))
    want = chunk_static(numels, dtype, dp, distopt, None, ddp, bucket)
    assert measured == (want.params, want.grads, want.optimizer), (buckets, measured, want)
    if ddp.overlap_grad_reduce:
        assert buckets[0] > 1  # the setting splits the buffer
