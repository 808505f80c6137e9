"""--moe-token-dispatcher-type flex: HybridEP (--moe-flex-dispatcher-backend hybridep) and DeepEP
(deepep, megatron-core's default) forecast on the GPU kernel set, with their buffers outside the
allocator in what a GPU needs; megatron-core's, DeepEP's and HybridEP's flex rules and the CPU
kernel set refused with one paragraph each, before any probe."""

from __future__ import annotations

import json

import pytest
from test_cli_errors import cli, one_error

from capture_megatron.config import GIB
from capture_megatron.features.dispatch import (
    DeepepConfig,
    deepep_buffer_bytes,
    deepep_received,
    hybridep_buffer_bytes,
)
from capture_megatron.features.moe import Experts
from capture_megatron.planner.margins import CONTEXT_GIB, RESERVE_FRACTION
from capture_megatron.rules.megatron import CPU_REFUSAL, flex_problems

CONTEXT = CONTEXT_GIB * GIB

MOE = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 64 --vocab-size 256 --micro-batch-size 1 "
    "--global-batch-size 4 --bf16 --num-experts 4 --moe-router-topk 2 --disable-bias-linear "
    "--moe-token-dispatcher-type flex --gpus 2 --no-progress"
).split()
EP2 = ["--expert-model-parallel-size", "2"]
HYBRID = ["--moe-flex-dispatcher-backend", "hybridep"]


def _run(command, argv, tmp_path):
    extra = ["--gpu-memory-gib", "80"] if command == "plan" else []
    return cli([command, *MOE, *argv, *extra], str(tmp_path))


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            ["--expert-model-parallel-size", "24", "--num-experts", "24", "--gpus", "24"]
            + ["--global-batch-size", "24"],
            "not 24",
        ),
        (["--fp16"], "bfloat16 tokens only"),
        (["--moe-deepep-num-sms", "21"], "even number"),
        (
            ["--moe-expert-capacity-factor", "1", "--moe-pad-expert-input-to-capacity"],
            "moe_pad_expert_input_to_capacity",
        ),
    ],
)
def test_deepep_refuses_what_megatron_and_deepep_refuse(extra, words, tmp_path):
    """DeepEP (megatron-core's default backend) is forecast; what megatron-core or DeepEP
    eb9cee7 refuses is refused in one paragraph before any probe, naming the change."""
    argv = [w for w in MOE if w != "--bf16" or "--fp16" not in extra]
    done = cli(["predict", *argv, *EP2, *extra, "--device", "fake-cuda"], str(tmp_path))
    line = one_error(done, "predict")
    assert words in line
    assert "profiling" not in done.stdout + done.stderr


def test_deepep_groups_and_buffers_follow_deepep_eb9cee7():
    """deep_ep/buffer.py's configs and csrc/config.hpp's size hints: within a node (8 ranks,
    hidden 4096, 20 SMs = 10 channels) NVLink only, 256 receive tokens per channel and rank, each
    with its hidden bytes, 8 bytes of source metadata, 128 top-k int64 indices and float32
    weights and 128 float32 scales; across 4 nodes (32 ranks) 288 NVLink and 128 RDMA tokens
    (aligned up to the 32-token send chunk: 128), twice per RDMA rank; the 32 MiB workspace."""
    per_token = 8192 + 8 + 128 * 12 + 512

    def aligned(n):
        return -(-n // 128) * 128

    nvl8 = aligned(10 * 8 * (2 * 1 + 3) * 4 + 10 * 8 * 256 * per_token)
    assert DeepepConfig.of("dispatch", 8).nvl_bytes(8192, 8) == nvl8
    assert deepep_buffer_bytes(4096, 8) == nvl8 + 8 * 20 + 32 * 2**20
    nvl32 = aligned(10 * 8 * (2 * 4 + 3) * 4 + 10 * 8 * 288 * per_token)
    rdma32 = aligned(10 * 4 * 18 * 2 * 4 + 10 * 4 * 128 * (per_token + 16) * 2)
    assert deepep_buffer_bytes(4096, 32) == nvl32 + 8 * 20 + rdma32 + 32 * 2**20
    assert deepep_buffer_bytes(4096, 8, num_sms=40) > deepep_buffer_bytes(4096, 8)
    moe = Experts(num_experts=48, moe_token_dispatcher_type="flex")
    assert flex_problems(moe, "bf16", 16, 8) == []
    assert "not 24" in flex_problems(moe, "bf16", 24, 8)[0]  # a config but no kernel


def test_deepep_receives_the_routing_forecast():
    """Unpadded dropless routing at a factor: from each rank min(tokens, ceil(tokens x top-k x
    factor / experts)) per local expert; distinct tokens by the share of a token's top-k on the
    rank's experts (one local expert: every pair a distinct token)."""
    mixtral = deepep_received(2048, 8, 8, 2, 1, 1.25)
    assert mixtral.per_expert == (8 * 640,) and mixtral.tokens == 8 * 640
    assert mixtral.node_tokens == 0
    qwen = deepep_received(2048, 32, 128, 8, 4, 1.0)
    assert qwen.routed == 4 * 32 * 128
    share = (1 - 0.7700) / 0.25  # 1 - C(124, 8) / C(128, 8), over top-k x local / experts
    assert abs(qwen.tokens / qwen.routed - share) < 0.01
    assert 0 < qwen.node_tokens <= 4 * 2048
    assert deepep_received(100, 8, 8, 2, 1, 4.0).per_expert == (800,)  # capped at the tokens


@pytest.mark.parametrize("command", ["predict", "plan"])
@pytest.mark.parametrize("backend", [[], HYBRID])
def test_flex_on_the_cpu_kernel_set_names_the_gpu_set(command, backend, tmp_path):
    done = _run(command, [*EP2, *backend, "--device", "cpu"], tmp_path)
    line = one_error(done, command)
    assert CPU_REFUSAL in line and "GPU kernel set" in line
    assert "profiling" not in done.stdout + done.stderr


def test_flex_needs_tp_x_ep_above_one(tmp_path):
    done = _run("predict", ["--expert-model-parallel-size", "1", *HYBRID], tmp_path)
    assert "TPxEP > 1" in one_error(done, "predict")


def test_hybridep_needs_16_bit_tokens(tmp_path):
    fp32 = [w for w in MOE if w != "--bf16"]
    done = cli(["predict", *fp32, *EP2, *HYBRID, "--device", "fake-cuda"], str(tmp_path))
    assert "--bf16 or --fp16" in one_error(done, "predict")


def test_group_must_be_whole_nvlink_domains():
    moe = Experts(
        num_experts=24, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep"
    )
    assert flex_problems(moe, "bf16", 8, 8) == []
    assert flex_problems(moe, "bf16", 16, 8) == []
    assert "whole NVLink domains" in flex_problems(moe, "bf16", 12, 8)[0]
    assert flex_problems(moe, "bf16", 12, 72) == []  # one GB200 NVL72 domain
    assert CPU_REFUSAL in flex_problems(moe, "bf16", 8, 8, cpu=True)
    dense = Experts()
    assert flex_problems(dense, "bf16", 1, 8) == []


def test_backend_is_left_out_of_record_keys_at_its_default():
    """A new Experts field would change every MoE record's key; at megatron's default (deepep)
    the JSON, hence the key, is what it was before the field existed."""
    default = Experts(num_experts=4)
    assert "moe_flex_dispatcher_backend" not in default.to_json()
    hybrid = Experts(num_experts=4, moe_flex_dispatcher_backend="hybridep")
    assert '"moe_flex_dispatcher_backend": "hybridep"' in hybrid.to_json()
    assert Experts.from_json(hybrid.to_json()) == hybrid
    assert Experts.from_json(default.to_json()) == default


def test_hybridep_buffers_follow_deepep_eb9cee7():
    """Megatron-LM's DeepSeek-V3 example (TP 1, EP 8, micro-batch 4 x 4096 tokens, hidden 7168,
    256 experts): one NVLink domain of 8, M = 16384 x 8 rows of a uint16 token buffer, float32
    probabilities over 32 x 8 experts and float32 scaling factors over 7168 / 128 blocks."""
    m = 16384 * 8
    want = m * 7168 * 2 + m * 32 * 8 * 4 + m * 56 * 4
    assert hybridep_buffer_bytes(7168, 16384, 8, 32, 8) == want
    # fewer than 512 tokens: HybridEPBuffer's floor
    assert hybridep_buffer_bytes(64, 100, 2, 2, 8) == hybridep_buffer_bytes(64, 512, 2, 2, 8)
    # two nodes add the RDMA buffers of internode.cu (they grow with the nodes)
    one, two = (hybridep_buffer_bytes(1024, 4096, g, 4, 8) for g in (8, 16))
    t = 4096
    rdma = t * (2048 + 4 * 4 * 16 + 32) + t * (2048 + 4 * 32 + 32) + 2 * t * (2048 + 4 * 32)
    rdma += 4 * (t // 128) * 8
    assert two == 2 * one + rdma


@pytest.mark.slow
def test_flex_predicts_and_needs_its_buffers(tmp_path):
    """predict on the GPU kernel set: exit 0, and `need` is the peak plus the allocator reserve,
    the CUDA context and HybridEP's or DeepEP's buffers (alltoall: without them; the peaks
    themselves are compared in test_flex_emulation and test_deepep_emulation)."""
    base = [*EP2, "--device", "fake-cuda", "--moe-router-force-load-balancing"]
    backends = {"hybridep": HYBRID, "deepep": [], "alltoall": []}
    outside, notes = {}, {}
    for name, extra in backends.items():
        kind = "alltoall" if name == "alltoall" else "flex"
        line = [w if w != "flex" else kind for w in MOE] + base + extra
        done = cli(["predict", *line, "--json", str(tmp_path / f"{name}.json")], str(tmp_path))
        assert done.returncode == 0, done.stderr[-2000:]
        data = json.loads((tmp_path / f"{name}.json").read_text())
        peak = max(data["predicted_peak_bytes"])
        outside[name] = data["needed_bytes_per_gpu"] - peak * (1 + RESERVE_FRACTION) - CONTEXT
        notes[name] = " ".join(data["notes"])
    assert "HybridEP's communication buffers" in notes["hybridep"]
    assert "DeepEP's communication buffers" in notes["deepep"]
    assert "HybridEP" not in notes["alltoall"] and "DeepEP" not in notes["alltoall"]
    assert abs(outside["alltoall"]) <= 2
    assert abs(outside["hybridep"] - hybridep_buffer_bytes(64, 64, 2, 2, 8)) <= 2
    assert abs(outside["deepep"] - deepep_buffer_bytes(64, 2)) <= 2


def test_the_reasoning_compares_no_plain_data_parallel_plan_with_flex():
    """The reasoning's plain data-parallel alternative (EP 1) is not predicted for the flex
    dispatcher, which megatron-core refuses at EP 1: a DeepSeek-V3 plan profiled for 32 minutes
    and then stopped on that alternative's probes."""
    from dataclasses import replace

    from capture_megatron.config import ModelShape, ParallelPlan
    from capture_megatron.planner.explain import plain_dp
    from capture_megatron.planner.space import Space

    base = ModelShape(
        num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024
    )
    plan = ParallelPlan(
        tp=2, pp=2, dp=2, ep=2, micro_batch_size=1, global_batch_size=16, layers_per_stage=(2, 2)
    )
    for dispatcher, plain in (("alltoall", True), ("flex", False)):
        moe = Experts(num_experts=8, moe_token_dispatcher_type=dispatcher)
        assert (plain_dp(replace(base, moe=moe), Space(), plan) is not None) == plain
