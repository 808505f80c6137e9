"""FP8 training on the GPU kernel set (--fp8-format, --fp8-recipe, --fp8-param-gather): the bytes
of Transformer Engine's quantized tensors (their shapes in TE 5671fd36's make_empty), what the
fake-cuda layers keep against a tensor-by-tensor count, DDP's FP8 parameter buffer, and the
refusals (the CPU kernel set, training)."""

from __future__ import annotations

import dataclasses

import pytest
from test_cli_errors import cli, one_error

from capture_megatron.config import Kernels
from capture_megatron.features.fp8 import (
    quantized_bytes,
    saved_input_bytes,
    scaling_state_bytes,
    weight_cache_bytes,
)
from capture_megatron.forecast.static import layer_static, runs_static
from capture_megatron.records import Probe, ProbeShape, Variant

ROWS, COLS = 256, 512


def test_float8_tensors_hold_a_byte_per_usage_and_one_scale():
    """Float8Tensor (delayed, tensorwise): data and, on Hopper, its transpose; one fp32 scale."""
    for recipe in ("delayed", "tensorwise"):
        assert quantized_bytes(recipe, ROWS, COLS, True, True) == 2 * ROWS * COLS + 4
        assert quantized_bytes(recipe, ROWS, COLS, False, True) == ROWS * COLS + 4
        assert quantized_bytes(recipe, ROWS, COLS, False, False) == 0


def test_mxfp8_scales_are_te_make_empty_shapes():
    """MXFP8Quantizer.make_empty: row-wise scales [round_up(rows, 128), round_up(cols / 32, 4)],
    column-wise [round_up(rows / 32, 4), round_up(cols, 128)], one byte each."""
    data = ROWS * COLS
    assert quantized_bytes("mxfp8", ROWS, COLS, True, False) == data + 256 * 16
    assert quantized_bytes("mxfp8", ROWS, COLS, False, True) == data + 8 * 512
    assert quantized_bytes("mxfp8", 96, 64, True, False) == 96 * 64 + 128 * 4


def test_blockwise_scales_are_fp32_per_block():
    """Float8BlockQuantizer.get_scale_shape: weights in 128 x 128 blocks, activations in 1 x 128
    blocks, scale rows padded to 4, fp32."""
    data = ROWS * COLS
    both_weight = quantized_bytes("blockwise", ROWS, COLS, True, True, weight=True)
    assert both_weight == 2 * data + 4 * (2 * 4) + 4 * (4 * 4)
    assert quantized_bytes("blockwise", ROWS, COLS, False, True) == data + 4 * 2 * 512
    assert quantized_bytes("blockwise", ROWS, COLS, True, False) == data + 4 * 4 * 256


def test_saved_inputs_weight_copies_and_scaling_state():
    """The saved input is column-wise, or row-wise when a per-tensor-scaled input is gathered in
    backward; a weight's FP8 workspace holds both usages, an FP8 parameter adds all but its
    row-wise data; delayed scaling keeps 5 scales and 5 amax histories per GEMM."""
    col = quantized_bytes("mxfp8", ROWS, COLS, False, True)
    assert saved_input_bytes("mxfp8", ROWS, COLS, gathered=True) == col
    assert saved_input_bytes("delayed", ROWS, COLS, gathered=True) == ROWS * COLS + 4
    both = quantized_bytes("mxfp8", ROWS, COLS, True, True, weight=True)
    assert weight_cache_bytes("mxfp8", ROWS, COLS, param_gather=False) == both
    assert weight_cache_bytes("mxfp8", ROWS, COLS, param_gather=True) == both - ROWS * COLS
    assert scaling_state_bytes("delayed", 1, 1024) == 4 * (5 + 5 * 1024)
    assert scaling_state_bytes("tensorwise", 2, 1024) == 2 * 5 * 8
    assert scaling_state_bytes("mxfp8", 2, 1024) == 0


def test_fp8_parameters_get_a_one_byte_buffer_of_their_own():
    """--fp8-param-gather: DDP groups buffers by (param dtype, grad dtype): the FP8 weights in a
    1-byte param buffer; their gradients stay fp32 and Adam keeps fp32 state for them."""
    layer, mask = (64, 4096, 64, 8192), (False, True, False, True)
    got = layer_static(
        (), ((layer, (False,) * 4, 3),), (), "bf16", (1, 1), False, low_precision=(mask,)
    )
    n8, n16 = 3 * (4096 + 8192), 3 * 128
    assert got.params == n8 + 2 * n16
    assert got.grads == 4 * (n8 + n16)
    assert got.optimizer == 12 * (n8 + n16) + 4 * 12
    plain = runs_static((), ((layer, 3),), (), "bf16", 4, True)
    dist = layer_static(
        (), ((layer, (False,) * 4, 3),), (), "bf16", (4, 1), True, low_precision=(mask,)
    )
    assert dist.params < plain.params and dist.grads >= plain.grads


LLAMA_SP = Variant(
    dtype="bf16",
    recompute="selective",
    sequence_parallel=True,
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    dropout=False,
    untied=True,
)


@pytest.mark.slow
def test_fake_cuda_layers_keep_what_te_keeps_under_fp8():
    """Tensor by tensor, one Llama layer (TP 2 + SP, selective recompute) under FP8 against bf16:
    linear_qkv and linear_fc1 keep their normalised input as the row-wise FP8 local shard (it is
    gathered in backward) instead of bf16; linear_proj keeps a column-wise FP8 copy of the
    attention output, whose bf16 tensor then dies (selective recompute keeps no attention
    output); linear_fc2 keeps the SwiGLU output in FP8 instead of bf16. Each layer keeps its four
    weights' FP8 workspaces and scaling state; with --fp8-param-gather their column-wise copies
    only, and the four weights are FP8 parameters."""
    from capture_megatron.profile.session import run_probes

    b, s, h, a, f, t = 2, 128, 128, 4, 256, 2
    shape = ProbeShape(b, s, h, a, a, h // a, f, 256, t)
    probes = [Probe(LLAMA_SP, shape, "middle", n) for n in (1, 2)]
    n_local, rows = s * b // t, s * b
    weights = [(3 * h // t, h), (h, h // t), (2 * f // t, h), (h, f // t)]
    bf16_1, bf16_2 = run_probes(probes, "fake-cuda", Kernels(), progress=False)
    for recipe in ("delayed", "mxfp8", "blockwise"):
        fp8 = Kernels(fp8_format="hybrid", fp8_recipe=recipe, fp8_amax_history_len=16)
        one, two = run_probes(probes, "fake-cuda", fp8, progress=False)
        kept = (
            saved_input_bytes(recipe, n_local, h, True) - 2 * n_local * h  # qkv
            + saved_input_bytes(recipe, rows, h // t, False) - 2 * rows * h // t  # proj
            + saved_input_bytes(recipe, n_local, h, True) - 2 * n_local * h  # fc1
            + saved_input_bytes(recipe, rows, f // t, False) - 2 * rows * f // t  # fc2
        )  # fmt: skip
        layer = (two.saved_bytes - one.saved_bytes) - (bf16_2.saved_bytes - bf16_1.saved_bytes)
        assert layer == kept, recipe
        state = sum(weight_cache_bytes(recipe, o, i, False) for o, i in weights)
        state += 4 * scaling_state_bytes(recipe, 1, 16)
        assert (
            one.low_precision_state_bytes == state and two.low_precision_state_bytes == 2 * state
        ), recipe
        assert one.param_low_precision == () and bf16_1.low_precision_state_bytes == 0
    gather = dataclasses.replace(fp8, fp8_param_gather=True)
    (one,) = run_probes(probes[:1], "fake-cuda", gather, progress=False)
    copies = sum(weight_cache_bytes(fp8.fp8_recipe, o, i, True) for o, i in weights)
    assert one.low_precision_state_bytes == copies + 4 * scaling_state_bytes(fp8.fp8_recipe, 1, 16)
    fp8_numels = sorted(n for n, low in zip(one.param_numels, one.param_low_precision) if low)
    assert fp8_numels == sorted(o * i for o, i in weights)


BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --vocab-size 256 --micro-batch-size 1 --global-batch-size 2 "
    "--bf16 --no-progress"
).split()


@pytest.mark.parametrize("command", ["predict", "plan"])
def test_fp8_on_the_cpu_kernel_set_is_one_paragraph(command, tmp_path):
    extra = ["--gpu-memory-gib", "80"] if command == "plan" else []
    argv = [command, *BASE, "--fp8-format", "hybrid", "--device", "cpu", "--gpus", "2", *extra]
    line = one_error(cli(argv, str(tmp_path)), command)
    assert "--fp8-format hybrid" in line and "GPU kernel set" in line
    assert "--device fake-cuda" in line


def test_fp8_is_refused_where_it_is_not_modelled():
    from capture_megatron.rules.modelled import fp8_problem

    fp8 = Kernels(fp8_format="e4m3")
    key = "gpu:" + fp8.key()
    assert fp8_problem(key, fp8) == ""
    assert "custom recipe" in fp8_problem(key, dataclasses.replace(fp8, fp8_recipe="custom"))
    mx = dataclasses.replace(fp8, fp8_recipe="mxfp8", fp8_param_gather=True)
    assert "--reuse-grad-buf-for-mxfp8-param-ag" in fp8_problem("gpu:" + mx.key(), mx)
    local = dataclasses.replace(fp8, transformer_impl="local")
    assert "--transformer-impl local" in fp8_problem(key, local)
    assert "without FP8" in fp8_problem("gpu:" + Kernels().key(), fp8)
    assert fp8_problem("cpu", Kernels()) == ""


def test_training_refuses_fp8():
    from capture_megatron.rules.modelled import trainer_kernels_problem

    assert "does not run FP8" in trainer_kernels_problem(Kernels(fp8_format="hybrid"))
    assert trainer_kernels_problem(Kernels()) == ""


@pytest.mark.slow
def test_fake_cuda_experts_keep_what_te_keeps_under_fp8():
    """An alltoall MoE layer (EP 2, capacity-padded routing) under FP8, tensor by tensor against
    bf16: besides the attention's two layers, each expert GEMM keeps its input split as TE's
    column-wise FP8 copy (the permuted tokens and the SwiGLU output die), grouped or sequential
    experts alike; every expert weight keeps its FP8 workspace and each GEMM its scaling state."""
    from capture_megatron.features.moe import Experts
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import ExpertsProbe

    b, s, h, f, t, experts, topk, ep = 2, 128, 128, 256, 2, 4, 2, 2
    shape = ProbeShape(b, s, h, 4, 4, 32, f, 256, t)
    tokens = s * b // t  # at the dispatcher (SP)
    rows = (experts // ep) * ep * (tokens * topk // experts)  # capacity-padded, from each EP rank
    splits = experts // ep
    qkv = saved_input_bytes("delayed", tokens, h, True) - 2 * tokens * h  # as above
    proj = saved_input_bytes("delayed", s * b, h // t, False) - 2 * s * b * h // t
    want = qkv + proj + splits * 8 - rows * h - rows * f
    weights = [(3 * h // t, h), (h, h // t)] + [(2 * f, h), (h, f)] * splits
    state = sum(weight_cache_bytes("delayed", o, i, False) for o, i in weights)
    state += scaling_state_bytes("delayed", 2 + 2 * splits, 1)
    for grouped in (True, False):
        moe = Experts(
            num_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=grouped, moe_expert_capacity_factor=1.0,
            moe_pad_expert_input_to_capacity=True, moe_aux_loss_coeff=0.01,
        )  # fmt: skip
        variant = dataclasses.replace(LLAMA_SP, moe=ExpertsProbe(moe, ep, 1, "exact"))
        probes = [Probe(variant, shape, "middle", n) for n in (1, 2)]
        bf16 = run_probes(probes, "fake-cuda", Kernels(), progress=False)
        fp8 = run_probes(probes, "fake-cuda", Kernels(fp8_format="hybrid"), progress=False)
        layer = lambda r: r[1].saved_bytes - r[0].saved_bytes  # noqa: E731
        assert layer(fp8) - layer(bf16) == want, grouped
        assert fp8[0].low_precision_state_bytes == state, grouped


def test_mla_takes_the_fp8_duplicated_down_projections():
    """megatron-core's MLA accepts its down projections by `linear_q_down_proj in [TELinear]`;
    on the GPU kernel set TELinear is DuplicatedLinear, and under FP8 the spec hands it a
    subclass (duplicated_linear(fp8)), which must pass that check (an MLA model with FP8 failed
    to build: 'Unsupported linear_q_down_proj')."""
    from capture_megatron.emulate.gpu.fp8 import Fp8Setting
    from capture_megatron.emulate.gpu.linear import (
        AnyDuplicatedLinear,
        DuplicatedLinear,
        duplicated_linear,
    )

    fp8 = duplicated_linear(Fp8Setting("tensorwise", False, 1))
    assert fp8 is not DuplicatedLinear and fp8 in [AnyDuplicatedLinear()]
    assert DuplicatedLinear in [AnyDuplicatedLinear()]
    assert object not in [AnyDuplicatedLinear()]
