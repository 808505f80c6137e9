"""Issue 28, search time: the throughput search drops candidates whose memory floor
(plan/ranktimes.memory_floor: parameters, gradients, the optimizer share, every layer's input per
micro-batch in flight, an MoE layer's routed tokens and first expert projection, the last rank's
logits) plus margins exceeds the GPU, without profiling them. A floor above the forecast would
drop a plan that fits, so on real profiles (fake CUDA, a tiny dense and a tiny MoE model with a
dense first layer) every candidate's floor must not exceed its least forecast: the exact min-max
memory split, every layer recomputed when it recomputes in full. Slow (profiles)."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan, Recompute
from capture_megatron.features.moe import Experts
from capture_megatron.planner.balance import balanced, evaluate_plan
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.ranktimes import memory_floor
from capture_megatron.planner.routing import routed
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.supply import needs_of
from capture_megatron.profile import memory_source
from capture_megatron.steptime.model import CostModel

pytestmark = pytest.mark.slow

DENSE = ModelShape(
    num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=1000,
    dtype="bf16", hidden_dropout=0.0, attention_dropout=0.0, swiglu=True,
    normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
)  # fmt: skip
MOE = dataclasses.replace(
    DENSE,
    moe=Experts(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                moe_layer_freq="([0]*1+[1]*7)", moe_grouped_gemm=True,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
)  # fmt: skip
SPACE = Space(tp=(1, 2), vpp=(1, 2), micro_batch_size=(1, 4), ep=(1, 2),
              recompute=("selective", "full"), sequence_parallel=(True,),
              distributed_optimizer=(True,))  # fmt: skip


def _lightest(plan: ParallelPlan) -> ParallelPlan:
    if plan.recompute.granularity != "full":
        return plan
    return dataclasses.replace(plan, recompute=Recompute("full", "uniform", (1,) * plan.pp))


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense", "moe"])
def test_the_floor_never_exceeds_the_forecast(shape, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path))
    shape = routed(shape, "planning")
    cluster = Cluster(gpus=8, gpu_memory_bytes=80 * GIB)
    plans = [_lightest(p) for p in candidates(shape, cluster, 32, SPACE) if p.pp in (2, 4)]
    assert {p.ep for p in plans} == ({1, 2} if shape.moe.enabled else {1})
    model = memory_source(shape, "fake-cuda", progress=False)(needs_of(shape, plans))
    ratios = []
    for plan in plans:
        split = balanced(model, shape, plan, keep_recompute=True)
        peak = evaluate_plan(model, shape, split, cluster, Margins(), CostModel()).peak
        ratios.append((memory_floor(shape, plan) / peak, plan))
    worst = max(ratios, key=lambda r: r[0])
    assert worst[0] <= 1, worst[1]
    # it bites where the search needs it: larger micro-batches raise it (activations counted)
    for plan in (p for p in plans if p.micro_batch_size == 4):
        small = dataclasses.replace(
            plan, micro_batch_size=1, global_batch_size=plan.global_batch_size // 4
        )
        assert memory_floor(shape, plan) > memory_floor(shape, small)
