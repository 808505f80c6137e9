"""Issue 53: what makes a plan quicker changes no answer. The planner's memos (a layer's and the
head's step time keyed by the plan fields they read, capture_megatron.steptime.parts; the step
bound's parts per candidate; a ParallelPlan's and a DdpOptions' hash computed once,
serial.CachedHash) and the profiling rounds' refit of only the variants they added records to
(fit's memo, capture_megatron.profile.source) give what the computation itself gives."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from capture_megatron.config import DdpOptions, ModelShape, ParallelPlan, Recompute
from capture_megatron.config.presets import preset
from capture_megatron.features.moe import Experts
from capture_megatron.fit import fit
from capture_megatron.steptime import parts
from capture_megatron.steptime.model import CostModel

MOE = dataclasses.replace(
    preset("llama3-8b"),
    moe=Experts(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1024,
                moe_grouped_gemm=True, moe_aux_loss_coeff=0.01),
)  # fmt: skip


def _plans(base: ParallelPlan) -> list[ParallelPlan]:
    """`base` with other values of the fields a layer's time must not depend on (PP, VPP, the
    layout, the global batch, the micro-batch group, the per-stage recompute counts)."""
    n = sum(base.layers_per_stage)
    out = []
    for pp, vpp in ((1, 1), (2, 1), (4, 2), (8, 4)):
        layers = (n // (pp * vpp),) * (pp * vpp)
        counts = tuple(range(pp)) if base.recompute.granularity == "full" else ()
        rc = dataclasses.replace(base.recompute, num_layers=counts)
        for gbs in (base.global_batch_size, 4 * base.global_batch_size):
            out.append(dataclasses.replace(base, pp=pp, vpp=vpp, layers_per_stage=layers,
                                           global_batch_size=gbs, recompute=rc))  # fmt: skip
    return out


@pytest.mark.parametrize("shape", [preset("llama3-8b"), MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_layer_time_is_the_same_on_every_stage_as_the_memo_assumes(shape, recompute):
    s = CostModel().setting
    rc = Recompute(recompute, "block", (0,) if recompute == "full" else ())
    ep = 2 if shape.moe.enabled else 1
    base = ParallelPlan(tp=2, pp=1, dp=4, micro_batch_size=2, global_batch_size=64, ep=ep,
                        layers_per_stage=(shape.num_layers,), recompute=rc,
                        sequence_parallel=True, distributed_optimizer=True)  # fmt: skip
    moe = shape.moe.enabled
    want = (parts._layer_time(s, shape, base, moe), parts.head(s, shape, base))
    for plan in _plans(base):
        assert parts._layer_key(s, shape, plan, moe) == parts._layer_key(s, shape, base, moe)
        got = (parts._layer_time(s, shape, plan, moe), parts.head(s, shape, plan))
        assert got == want, plan
        assert parts.layer_time(s, shape, plan, moe) == want[0]
        assert parts.head_time(s, shape, plan) == (want[1].forward, want[1].backward)


def test_a_plan_hashes_once_as_its_fields_and_pickles_without_it():
    ddp = DdpOptions(overlap_grad_reduce=True)
    plan = ParallelPlan(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8,
                        layers_per_stage=(4, 4), ddp=ddp)  # fmt: skip
    twin = dataclasses.replace(plan)
    assert twin is not plan and twin == plan and hash(twin) == hash(plan)
    assert hash(plan.ddp) == hash(dataclasses.replace(plan.ddp))
    other = dataclasses.replace(plan, dp=4, global_batch_size=16)
    assert {plan: 1, other: 2}[twin] == 1
    back = pickle.loads(pickle.dumps(plan))
    assert "_cached_hash" in vars(plan) and "_cached_hash" not in vars(back)
    assert back == plan and hash(back) == hash(plan)
    assert ParallelPlan.from_json(plan.to_json()) == plan


SMALL = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                   max_position_embeddings=64, vocab_size=256, dtype="fp32")  # fmt: skip


@pytest.mark.slow
def test_a_refit_keeps_the_variants_it_added_no_records_to():
    from capture_megatron.profile import ProfileOptions, profile
    from capture_megatron.records import Variant

    variants = (Variant.of(SMALL, "none"), Variant.of(SMALL, "selective"))

    def profiled(variant: Variant, micro_batch: int) -> list:
        options = ProfileOptions(device="cpu", design=False, progress=False, tps=(1,),
                                 micro_batch_sizes=(micro_batch,), variants=(variant,))  # fmt: skip
        return list(profile(SMALL, options))

    first = profiled(variants[0], 1) + profiled(variants[1], 1)
    memo: dict = {}
    before = fit(first, memo)
    assert before == fit(first)
    records = first + profiled(variants[0], 2)
    after = fit(records, memo)
    assert after == fit(records)
    kept = {v.variant: v for v in before.variants}
    now = {v.variant: v for v in after.variants}
    assert now[variants[1]] is kept[variants[1]]  # no records added: the same fit
    assert now[variants[0]] is not kept[variants[0]] and now[variants[0]] != kept[variants[0]]
