"""The step-time model's MoE structure (capture_megatron.steptime.moe), the time of the MoE knobs
(recompute modules, EP overlap, shared-expert overlap, the dispatchers, CUDA graphs,
Megatron-FSDP), multi-latent attention and multi-token prediction, and the step breakdown printed
side by side (capture_megatron.steptime.breakdown). Pure Python, no profiling."""

from __future__ import annotations

import dataclasses
import os

import pytest

from capture_megatron.config import DdpOptions, ModelShape, ParallelPlan, Recompute
from capture_megatron.config.hf import from_hf_config
from capture_megatron.steptime import moe as mo
from capture_megatron.steptime import parts as costparts
from capture_megatron.steptime.breakdown import breakdown, outpaces, side_by_side
from capture_megatron.steptime.hardware import PROFILES
from capture_megatron.steptime.model import CostModel, model_flops, step_seconds, step_time
from capture_megatron.steptime.settings import StepSettings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DSV3 = from_hf_config(os.path.join(ROOT, "tests/data/hf_configs/DeepSeek-V3.json"), 4096)


def _moe(**changes) -> ModelShape:
    """DeepSeek-V3 with some MoE options changed."""
    return DSV3.replace(moe=dataclasses.replace(DSV3.moe, **changes))


def _plan(ep: int = 64, pp: int = 8, vpp: int = 1, dp: int = 32, **kw) -> ParallelPlan:
    """DeepSeek-V3's published H100 layout at 512 GPUs (NeMo 25.04: 7 / 6 x 8 / 6 layers; with
    virtual stages the same rule over pp x vpp stages)."""
    stages = pp * vpp
    middle = 64 // stages
    split = (middle - 1,) + (middle,) * (stages - 2) + (middle - 2,)
    fields = dict(
        tp=2, pp=pp, vpp=vpp, dp=dp, ep=ep, etp=1, micro_batch_size=1, sequence_parallel=True,
        global_batch_size=8 * dp, layers_per_stage=split, distributed_optimizer=True,
        mtp_layers=DSV3.mtp_num_layers,
    )  # fmt: skip
    fields.update(kw)
    return ParallelPlan(**fields)


ALLTOALL = _moe(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)
S = CostModel().setting


def test_more_expert_parallelism_sends_more_across_nodes():
    """Inside one NVLink domain the all-to-all runs over NVLink; as EP spans more nodes a larger
    share of each rank's tokens leaves over its own NIC: the dispatch takes longer. DeepEP sends a
    token once per remote node its experts sit in, so it beats the all-to-all across nodes; on a
    GB200 NVL72 rack HybridEP keeps EP 64 on NVLink, DeepEP (8 NVLink peers) does not."""
    times = [mo.block(S, ALLTOALL, _plan(ep=ep)).dispatch for ep in (8, 16, 32, 64)]
    assert times == sorted(times) and times[0] * 5 < times[1]
    deepep = _moe(moe_token_dispatcher_type="flex", moe_grouped_gemm=True)
    hybridep = _moe(
        moe_token_dispatcher_type="flex",
        moe_grouped_gemm=True,
        moe_flex_dispatcher_backend="hybridep",
    )
    h100 = mo.block(S, deepep, _plan()).dispatch
    assert h100 < 0.7 * times[-1] and mo.block(S, hybridep, _plan()).dispatch == h100
    rack = CostModel(hardware=PROFILES["gb200"]).setting
    assert mo.block(rack, hybridep, _plan()).dispatch < h100 / 3
    assert mo.block(rack, deepep, _plan()).dispatch > h100 / 2


def test_few_tokens_per_expert_lower_the_grouped_gemms_efficiency():
    """Each expert computes whole tiles and reads its weights whatever its tokens: the experts'
    FLOP/s fall as tokens per expert fall (shorter sequences, more EP ranks' experts split
    thinner)."""

    def rate(seq: int) -> tuple[float, float]:
        shape = ALLTOALL.replace(seq_length=seq)
        b = mo.block(S, shape, _plan())
        flops = 2 * 3 * shape.hidden_size * shape.moe_ffn * b.tokens_per_expert * 4  # 4 experts
        return b.tokens_per_expert, flops / (b.experts - b.activation)

    rates = [rate(seq) for seq in (4096, 512, 64, 16)]
    assert [t for t, _ in rates] == sorted((t for t, _ in rates), reverse=True)
    assert [r for _, r in rates] == sorted((r for _, r in rates), reverse=True)
    assert rates[-1][1] < 0.25 * rates[0][1]


def test_overlap_hides_communication():
    """The merged 1F1B schedule (--overlap-moe-expert-parallel-comm) hides dispatch and combine
    behind the other micro-batch's attention and MLP, more with --delay-wgrad-compute; the shared
    experts hide some behind them with --moe-shared-expert-overlap."""
    plan = _plan(vpp=2, ep=16)  # megatron-core: EP overlap at PP > 1 needs virtual stages
    over = plan.replace(ddp=DdpOptions(overlap_moe_expert_parallel_comm=True))

    def ep(p: ParallelPlan, **settings) -> float:
        s = CostModel(settings=StepSettings(**settings)).setting
        return costparts.layer_time(s, ALLTOALL, p, moe=True).parts.ep

    plain = ep(plan)
    assert 0 < ep(over, delay_wgrad_compute=True) < ep(over) < plain / 2
    assert ep(plan, moe_shared_expert_overlap=True) < plain
    st = [step_seconds(ALLTOALL, p) for p in (plan, over)]
    assert st[1] < st[0]
    inside = _plan(vpp=2, ep=8).replace(ddp=over.ddp)  # NVLink: the compute hides all of it
    assert ep(inside) == 0.0


def test_imbalance_slows_the_step():
    """The busiest EP rank sets the layer's time: the routing forecast's imbalance (dropless) or a
    given factor makes the step longer than balanced routing; padded to capacity, the capacity
    factor counts."""
    balanced = _moe(moe_token_dispatcher_type="alltoall", moe_router_force_load_balancing=True)
    forecast = _moe(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-4)
    skewed = [
        _moe(moe_token_dispatcher_type="alltoall", moe_imbalance_factor=f) for f in (1.3, 1.6)
    ]
    plan = _plan()
    assert mo.imbalance(balanced, plan) == 1.0 < mo.imbalance(forecast, plan)
    assert mo.imbalance(skewed[1], plan) == 1.6
    t = [step_seconds(x, plan) for x in (balanced, *skewed)]
    assert t[0] < t[1] < t[2] and step_seconds(forecast, plan) > t[0]
    padded = _moe(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True)
    assert mo.imbalance(padded, plan) == 1.25


def test_recompute_modules_cost_their_own_forward():
    """Selective recompute re-runs each chosen module's forward: the whole MoE block (its
    dispatch and combine included) costs more than its experts' activation, which costs more than
    nothing; MLA's up-projections and the norms count on an MoE layer too."""

    def redo(*modules: str) -> float:
        plan = _plan(recompute=Recompute("selective", modules=modules))
        return costparts.layer_time(S, ALLTOALL, plan, moe=True).recomputed_forward

    block = mo.block(S, ALLTOALL, _plan())
    assert redo("moe") > redo("moe_act") > 0 and redo("moe") > block.comm
    assert redo("shared_experts") == pytest.approx(block.shared)
    assert redo("moe", "mla_up_proj", "layernorm") > redo("moe")
    assert redo("mlp") == 0.0  # an MoE layer has no dense MLP


def test_cuda_graphs_save_launches_only_where_the_host_is_the_bound():
    """A layer whose kernels take less than their launches waits on the host; CUDA graphs launch
    a captured scope once. A layer with long kernels is not host-bound: graphs change nothing."""
    tiny = ALLTOALL.replace(hidden_size=512, seq_length=128, num_attention_heads=8)
    tiny = tiny.replace(moe=dataclasses.replace(tiny.moe, moe_ffn_hidden_size=64))
    plan = _plan(ep=8)

    def seconds(shape, **settings) -> float:
        return step_seconds(shape, plan, CostModel(settings=StepSettings(**settings)))

    graphs = dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=("attn", "moe_router"))
    assert seconds(tiny, **graphs) < seconds(tiny)
    assert seconds(ALLTOALL, **graphs) == pytest.approx(seconds(ALLTOALL))
    full = dict(cuda_graph_impl="local", cuda_graph_scope=("full_iteration",))
    assert seconds(tiny, **full) < seconds(tiny, **graphs)


@pytest.mark.skipif(
    not hasattr(DdpOptions(), "use_megatron_fsdp"), reason="the Megatron-FSDP options are not here"
)
def test_megatron_fsdp_gathers_every_micro_batch():
    """optim_grads_params all-gathers each layer's parameters twice per micro-batch and
    reduce-scatters its gradients: slower than the distributed optimizer at the same sizes when
    the per-layer compute cannot hide it (DP over nodes, short sequences)."""
    shape = ALLTOALL.replace(seq_length=256)
    plan = _plan()
    fsdp = plan.replace(
        ddp=dataclasses.replace(
            plan.ddp, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
        )
    )
    assert breakdown(step_time(shape, fsdp)).dp > breakdown(step_time(shape, plan)).dp


def test_mla_and_mtp_flops_match_nvidias_count():
    """DeepSeek-V3's model FLOPs with MLA's latent projections and the MTP layer: NVIDIA's count
    (NeMo 25.04 flops_formulas.deepseekv3, causal attention: 174.02 TFLOP/s/GPU x 48.948 s x 512
    GPUs / 4096 sequences) is ours with half the attention core (our convention counts the full
    s x s) and without the router GEMMs."""
    s, heads, layers = 4096, 128, 61 + 1
    attention = 3 * 2 * s * s * heads * (192 + 128) * layers
    nvidia = 174.02e12 * 48.948 * 512 / 4096
    assert model_flops(DSV3, 1) - attention / 2 == pytest.approx(nvidia, rel=0.005)


def test_mtp_layers_sit_on_the_last_stage():
    """The MTP layer (a transformer layer, its projection, its own output layer and loss) adds
    to the last stage's time, and to nothing else."""
    plan, bare = _plan(), _plan(mtp_layers=0)
    with_mtp = step_time(ALLTOALL, plan).chunks
    without = step_time(ALLTOALL, bare).chunks
    assert with_mtp[-1].forward > without[-1].forward
    assert [c.forward for c in with_mtp[:-1]] == [c.forward for c in without[:-1]]


def test_the_breakdown_adds_up_and_prints_side_by_side():
    """The breakdown's parts add up to the step; two plans print part by part with the
    difference; a plan claiming more than 15% over another is flagged."""
    a = step_time(ALLTOALL, _plan())
    b = step_time(
        ALLTOALL, _plan(ep=8, vpp=2, ddp=DdpOptions(overlap_moe_expert_parallel_comm=True))
    )
    for st in (a, b):
        parts = breakdown(st)
        assert sum(v for _, v in parts.rows()) == pytest.approx(st.seconds, rel=1e-9)
        assert parts.compute > 0 and parts.bubble > 0
    assert breakdown(a).ep > breakdown(b).ep == 0.0  # EP 8 overlapped: hidden on NVLink
    lines = side_by_side([("published", breakdown(a)), ("planned", breakdown(b))])
    assert "published" in lines[0] and "planned" in lines[0] and "difference" in lines[0]
    assert any(line.startswith("exposed EP communication") for line in lines)
    assert lines[-1].startswith("step")
    assert outpaces(b, a) == (b.tokens_per_s_per_gpu > 1.15 * a.tokens_per_s_per_gpu)


def test_group_limited_routing_sends_deepep_to_fewer_nodes():
    """DeepSeek-V3's config.json limits each token's 8 experts to 4 of 8 groups (n_group,
    topk_group: read into --moe-router-num-groups / --moe-router-group-topk); over EP 64 (8
    nodes, a group per node) DeepEP then sends a token to at most 4 nodes instead of the ~5.3 its
    experts would span unlimited, and the all-to-all, which sends every copy, is unchanged."""
    assert (DSV3.moe.moe_router_num_groups, DSV3.moe.moe_router_group_topk) == (8, 4)
    flex = dict(moe_token_dispatcher_type="flex", moe_grouped_gemm=True)
    limited = mo.block(S, _moe(**flex), _plan()).dispatch
    free = mo.block(S, _moe(**flex, moe_router_num_groups=0, moe_router_group_topk=0), _plan())
    assert limited < 0.85 * free.dispatch
    plain = _moe(moe_router_num_groups=0, moe_router_group_topk=0)
    assert mo.block(S, ALLTOALL, _plan()).dispatch == mo.block(S, plain.replace(
        moe=dataclasses.replace(plain.moe, moe_token_dispatcher_type="alltoall",
                                moe_grouped_gemm=True)), _plan()).dispatch  # fmt: skip


@pytest.mark.parametrize(
    "groups,limit", [(8, 0), (0, 4), (8, 9), (7, 4), (256, 1)]
)  # (256, 1): one group of one expert cannot hold the top-8
def test_group_limits_megatron_refuses_are_refused(groups, limit):
    from capture_megatron.errors import CaptureError

    with pytest.raises(CaptureError, match="--moe-router-num-groups"):
        _moe(moe_router_num_groups=groups, moe_router_group_topk=limit)
