"""--hf-config reads published config.json files right (tests/data/hf_configs, README there): the
parameter counts the model publishers state, tied embeddings and gated activations from each
type's transformers defaults, head_dim, QKV biases, RoPE base / scaling, norm epsilon and sliding
windows carried as Megatron-LM flags that parse back into the same model, bf16 training whatever
the file's storage type, the sequence length given or stated, model directories, and Gemma-2 read
but refused for planning. Fast (no profiling) except the one slow test that builds a GeGLU +
QKV-bias model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_cli_errors import cli, one_error

from capture_megatron.api.request import resolve_shape
from capture_megatron.cli.plan import build_parser
from capture_megatron.config import Kernels, ModelShape
from capture_megatron.config.hf import from_hf_config, parameter_count, read_hf_config
from capture_megatron.errors import CaptureError
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import model_shape
from capture_megatron.planner import model_args, model_notes
from capture_megatron.records import Variant
from capture_megatron.rules.modelled import window_problem

HF = Path(__file__).parents[1] / "data" / "hf_configs"
PUBLISHED = {
    # name: (published parameters, tied, gated activation, kv_channels, QKV bias)
    "gemma-7b": (8_537_680_896, True, "geglu", 256, False),
    "gemma-2-9b": (9_241_705_984, True, "geglu", 256, False),
    "Llama-3.1-70B-Instruct": (70_553_706_496, False, "swiglu", 0, False),
    "Qwen2.5-7B-Instruct": (7_615_616_512, False, "swiglu", 0, True),
    "Phi-3-mini-4k-instruct": (3_821_079_552, False, "swiglu", 0, False),
}
"""Published counts: keras-hub's Gemma presets (gemma_7b_en 8537680896, gemma2_9b_en 9241705984),
the Hub's safetensors totals of Llama-3.1-70B (70553706496) and Qwen2.5-7B-Instruct (7615616512),
keras-hub's phi3_mini_4k_instruct_en (3821079552); the model cards round them to 8.54B, 9.24B,
70.6B, 7.62B and 3.82B."""
PLANNABLE = sorted(set(PUBLISHED) - {"gemma-2-9b"})


def _parse(argv: list[str]):
    return flags.parse_flags(build_parser(), argv)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_read_to_their_parameter_counts(name):
    count, tied, gate, kv_channels, qkv_bias = PUBLISHED[name]
    shape = read_hf_config(str(HF / f"{name}.json")).shape
    assert parameter_count(shape) == pytest.approx(count, rel=0.01)
    assert shape.untie_embeddings_and_output_weights is not tied
    assert (shape.swiglu, shape.geglu) == (gate == "swiglu", gate == "geglu")
    assert (shape.kv_channels, shape.add_qkv_bias, shape.dtype) == (kv_channels, qkv_bias, "bf16")
    if name != "gemma-2-9b":  # Gemma-2's two extra norms per layer are not in megatron's layer
        assert parameter_count(shape) == count


MOE = {
    # name: (published parameters, routed experts, top-k, expert width, shared width, gate, freq)
    "Mixtral-8x7B-v0.1": (46.7e9, 8, 2, 0, 0, False, "1"),
    "Qwen2-57B-A14B": (57e9, 64, 8, 2560, 20480, True, "1"),
}
"""Published totals: Mistral AI's Mixtral 8x7B announcement (46.7B parameters), Qwen2's model card
(Qwen2-57B-A14B: 57B). Mixtral's routed experts keep intermediate_size (moe_ffn_hidden_size 0:
Megatron's default, the dense width)."""


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_configs_read_their_experts(name):
    count, experts, topk, width, shared, gate, freq = MOE[name]
    shape = read_hf_config(str(HF / f"{name}.json")).shape
    moe = shape.moe
    assert parameter_count(shape) == pytest.approx(count, rel=0.01)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (experts, topk, width)
    assert (moe.moe_shared_expert_intermediate_size, moe.moe_shared_expert_gate) == (shared, gate)
    assert moe.moe_layer_freq == freq and moe.dropless
    args = _parse([*model_args(shape), "--gpus", "8"])
    assert model_shape(args) == shape  # the emitted MoE flags parse back into the same model


def test_moe_layer_patterns_follow_each_types_rules(tmp_path):
    base = json.loads((HF / "Qwen2-57B-A14B.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, "decoder_sparse_step": 2, "mlp_only_layers": [5]}))
    shape = read_hf_config(str(path)).shape
    assert shape.moe_layers == tuple(i != 5 and i % 2 == 1 for i in range(28))
    assert shape.moe.moe_layer_freq.startswith("([0]*1+[1]*1+")
    heads = base["num_attention_heads"]  # MLA has no query groups (DeepSeek's configs: equal)
    v3 = {**base, "model_type": "deepseek_v3", "first_k_dense_replace": 3}
    v3["num_key_value_heads"] = heads
    path.write_text(json.dumps({k: v for k, v in v3.items() if k != "num_experts"}))
    shape = read_hf_config(str(path)).shape
    assert shape.moe.moe_layer_freq == "([0]*3+[1]*25)" and shape.moe.num_experts == 256
    qwen3 = {**base, "model_type": "qwen3_moe"}
    path.write_text(json.dumps(qwen3))
    assert read_hf_config(str(path)).checked().shape.qk_layernorm  # q_norm / k_norm


def test_absent_fields_take_each_types_transformers_default(tmp_path):
    gemma = json.loads((HF / "gemma-7b.json").read_text())
    assert "tie_word_embeddings" not in gemma and gemma["hidden_act"] == "gelu"
    read = read_hf_config(str(HF / "gemma-7b.json"))
    shape = read.shape
    assert not shape.untie_embeddings_and_output_weights and shape.geglu  # GemmaConfig: tied
    assert any("hidden_act 'gelu' is ignored" in note for note in read.notes)
    assert (shape.head_dim, shape.kv_channels, shape.norm_epsilon) == (256, 256, 1e-6)
    llama = json.loads((HF / "Llama-3.1-70B-Instruct.json").read_text())
    del llama["tie_word_embeddings"], llama["hidden_act"], llama["rms_norm_eps"]
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    shape = read_hf_config(str(tmp_path / "llama.json")).shape
    assert shape.untie_embeddings_and_output_weights and shape.swiglu  # LlamaConfig: untied
    assert shape.norm_epsilon == 1e-6
    del gemma["head_dim"]
    (tmp_path / "gemma.json").write_text(json.dumps(gemma))
    assert read_hf_config(str(tmp_path / "gemma.json")).shape.kv_channels == 256


def test_training_precision_is_bf16_whatever_the_file_stores(tmp_path):
    cfg = json.loads((HF / "gemma-7b.json").read_text())
    cfg["torch_dtype"] = "float32"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    read = read_hf_config(str(path))
    assert read.shape.dtype == "bf16"
    assert any("training precision bf16" in n and "float32" in n for n in read.notes)
    shape, notes = resolve_shape(_parse(["--hf-config", str(path), "--gpus", "8", "--fp16"]))
    assert shape.dtype == "fp16" and not any("precision" in n for n in notes)
    shape, _ = resolve_shape(_parse(["--hf-config", str(path), "--gpus", "8", "--bf16"]))
    assert shape.dtype == "bf16"


@pytest.mark.parametrize("name", PLANNABLE)
def test_model_args_parse_back_into_the_same_model(name):
    shape = from_hf_config(str(HF / f"{name}.json"), seq_length=4096)
    argv = model_args(shape)
    parser = flags.FlagParser()
    flags.add_model_flags(parser)
    assert model_shape(parser.parse_args(argv)) == shape
    text = " ".join(argv)
    expected = {
        "gemma-7b": ["--geglu", "--kv-channels 256", "--norm-epsilon 1e-06"],
        "Llama-3.1-70B-Instruct": [
            "--rotary-base 500000",
            "--use-rope-scaling",
            "--rope-scaling-factor 8.0",
            "--num-query-groups 8",
        ],
        "Qwen2.5-7B-Instruct": ["--add-qkv-bias", "--rotary-base 1000000", "--norm-epsilon 1e-06"],
        "Phi-3-mini-4k-instruct": ["--window-size 2047,0", "--swiglu"],
    }[name]
    for part in expected:
        assert part in text, (part, text)
    assert ("--geglu" in text) == shape.geglu and "--bf16" in text


def test_megatron_lm_spellings_of_the_new_flags_parse():
    ns = _parse(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 99 "
        "--gpus 1 --disable-bias-linear --add-qkv-bias --window-size (16,0) --rotary-base 500000 "
        "--use-rope-scaling --rope-scaling-factor 32 --norm-epsilon 1e-6 "
        "--position-embedding-type rope".split()
    )
    shape = model_shape(ns)
    assert (shape.add_qkv_bias, shape.window_size, shape.rotary_base) == (True, (16, 0), 500000)
    assert (shape.use_rope_scaling, shape.rope_scaling_factor, shape.norm_epsilon) == (
        True,
        32.0,
        1e-6,
    )
    assert any("factor 8" in n for n in model_notes(shape))  # stock Megatron-LM ignores it


def test_geglu_is_stated_as_beyond_stock_megatron_lm():
    shape = from_hf_config(str(HF / "gemma-7b.json"))
    (note,) = model_notes(shape)
    assert "stock Megatron-LM's pretrain_gpt.py cannot build" in note and "--geglu" in note
    assert model_notes(from_hf_config(str(HF / "Llama-3.1-70B-Instruct.json"))) == ()
    with pytest.raises(CaptureError, match="--swiglu and --geglu"):
        shape.replace(swiglu=True)


def test_sequence_length_is_given_or_stated(tmp_path):
    read = read_hf_config(str(HF / "Llama-3.1-70B-Instruct.json"))
    assert read.shape.seq_length == 4096
    assert (
        "sequence length 4096 (default; the config allows 131072 positions; give --seq-length)"
        in read.notes
    )
    given = read_hf_config(str(HF / "Llama-3.1-70B-Instruct.json"), seq_length=8192)
    assert given.shape.seq_length == 8192 and not any("sequence" in n for n in given.notes)
    with pytest.raises(CaptureError) as err:
        read_hf_config(str(HF / "gemma-7b.json"), seq_length=16384)
    assert "--seq-length 16384" in str(err.value) and "max_position_embeddings 8192" in str(
        err.value
    )
    argv = ["plan", "--hf-config", str(HF / "gemma-7b.json"), "--seq-length", "16384"]
    line = one_error(cli([*argv, "--gpus", "8", "--gpu-memory-gib", "80"], str(tmp_path)), "plan")
    assert "--seq-length 16384 is longer than the 8192 positions" in line, line


def test_a_model_directory_is_read_through_its_config_json(tmp_path):
    shutil.copy(HF / "Qwen2.5-7B-Instruct.json", tmp_path / "config.json")
    assert (
        read_hf_config(str(tmp_path)).shape == read_hf_config(str(tmp_path / "config.json")).shape
    )
    shape, _ = resolve_shape(_parse(["--hf-config", str(tmp_path), "--gpus", "8"]))
    assert shape.add_qkv_bias and shape.num_query_groups == 4
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CaptureError, match="is a directory without a config.json"):
        read_hf_config(str(empty))


def test_gemma2_is_read_but_planning_is_refused_by_field(tmp_path):
    read = read_hf_config(str(HF / "gemma-2-9b.json"), seq_length=8192)
    fields = [u.field for u in read.unmodelled]
    assert fields == [
        "post_attention_layernorm and post_feedforward_layernorm",
        "attn_logit_softcapping 50.0",
        "final_logit_softcapping 30.0",
        "sliding_window 4096",
    ]
    with pytest.raises(CaptureError) as err:
        read.checked()
    assert "9.24B parameters" in str(err.value) and "nothing is planned" in str(err.value)
    argv = ["plan", "--hf-config", str(HF / "gemma-2-9b.json"), "--gpus", "8"]
    line = one_error(cli([*argv, "--gpu-memory-gib", "80"], str(tmp_path)), "plan")
    for field in fields[:3]:
        assert field in line, line
    cfg = json.loads((HF / "gemma-2-9b.json").read_text())
    cfg["query_pre_attn_scalar"] = 144  # Gemma-2-27B's: not 1/sqrt(head_dim)
    (tmp_path / "g.json").write_text(json.dumps(cfg))
    assert "query_pre_attn_scalar 144" in [
        u.field for u in read_hf_config(str(tmp_path / "g.json")).unmodelled
    ]


def test_what_megatron_lm_cannot_build_is_refused_by_name(tmp_path):
    with pytest.raises(CaptureError, match="rope_scaling type 'longrope'"):
        read_hf_config(str(HF / "Phi-3-mini-128k-instruct.json"))
    llama = json.loads((HF / "Llama-3.1-70B-Instruct.json").read_text())
    cases = {
        "original_max_position_embeddings 32768": {
            "rope_scaling": dict(llama["rope_scaling"], original_max_position_embeddings=32768)
        },
        "rope_scaling type 'yarn'": {"rope_scaling": {"type": "yarn", "factor": 4.0}},
        "attention_bias true": {"attention_bias": True},
        "mlp_bias True": {"mlp_bias": True},
        "rope_theta 10000.5": {"rope_theta": 10000.5},
        "hidden_act 'relu'": {"hidden_act": "relu"},
    }
    for message, change in cases.items():
        (tmp_path / "c.json").write_text(json.dumps(dict(llama, **change)))
        with pytest.raises(CaptureError, match=message.replace("(", r"\(")):
            read_hf_config(str(tmp_path / "c.json"))


def test_windows_follow_each_types_rules(tmp_path):
    phi3 = read_hf_config(str(HF / "Phi-3-mini-4k-instruct.json"))
    assert phi3.shape.window_size == (2047, 0)
    assert any("changes no memory" in n for n in phi3.notes)
    qwen = json.loads((HF / "Qwen2.5-7B-Instruct.json").read_text())
    assert read_hf_config(str(HF / "Qwen2.5-7B-Instruct.json")).shape.window_size == ()
    (tmp_path / "q.json").write_text(json.dumps(dict(qwen, use_sliding_window=True)))
    assert read_hf_config(str(tmp_path / "q.json")).shape.window_size == ()  # layers >= 28 only
    (tmp_path / "q.json").write_text(
        json.dumps(dict(qwen, use_sliding_window=True, max_window_layers=4, sliding_window=1024))
    )
    with pytest.raises(CaptureError, match="max_window_layers 4"):
        read_hf_config(str(tmp_path / "q.json"))
    mistral = read_hf_config(str(HF / "Mistral-7B-v0.1.json"), seq_length=8192)
    assert mistral.shape.window_size == (4096, 0)
    gpu = "gpu:" + Kernels().for_gpu().key()
    assert window_problem(mistral.shape, gpu, Kernels()) == ""
    assert window_problem(mistral.shape, "cpu", Kernels()) == ""
    unfused = Kernels(attention_backend="unfused")
    assert "--attention-backend unfused" in window_problem(mistral.shape, gpu, unfused)


def test_old_json_without_the_new_fields_still_loads():
    shape = ModelShape(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=99
    )
    plain = json.loads(shape.to_json())
    new = ("geglu", "add_qkv_bias", "norm_epsilon", "rotary_base", "use_rope_scaling")
    for name in (*new, "rope_scaling_factor", "window_size"):
        del plain[name]
    assert ModelShape.from_json(json.dumps(plain)) == shape
    variant = json.loads(Variant.of(shape).to_json())
    for name in ("geglu", "add_qkv_bias", "window_size"):
        del variant[name]
    assert Variant.from_json(json.dumps(variant)) == Variant.of(shape)


@pytest.mark.slow
def test_geglu_and_qkv_bias_build_the_counted_parameters():
    from capture_megatron.profile.probed import model_shape as probe_model
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import Probe, ProbeShape

    shape = ModelShape(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=256,
        ffn_hidden_size=96,
        num_query_groups=2,
        geglu=True,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        add_bias_linear=False,
        add_qkv_bias=True,
        window_size=(8, 0),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    probe = Probe(Variant.of(shape), ProbeShape.of(shape, 1, 2), "only", 2)
    (record,) = run_probes([probe], "cpu", progress=False)
    built = probe_model(probe)
    assert built.geglu and built.add_qkv_bias and built.window_size == (8, 0)
    assert sum(record.param_numels) == parameter_count(built) == parameter_count(shape)
    assert record.param_bytes == 4 * parameter_count(shape)  # fp32
    qkv_bias = (4 + 2 * 2) * 16
    plain = parameter_count(shape.replace(geglu=False, swiglu=True, add_qkv_bias=False))
    assert parameter_count(shape) - plain == 2 * qkv_bias  # two layers' QKV biases


def test_our_pretrain_gpt_takes_the_emitted_flags_and_megatron_lm_refuses_geglu(tmp_path):
    from capture_megatron.cli.megatron_lm import megatron_args_for
    from capture_megatron.train.entry import parse_config

    shape = from_hf_config(str(HF / "gemma-7b.json")).replace(num_layers=2, seq_length=64)
    batch = ["--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data"]
    config = parse_config([*model_args(shape), *batch], world_size=1)
    assert config.shape == shape and config.shape.geglu
    argv = [*model_args(shape), "--micro-batch-size", "1"]  # the flags the plan emitted for Gemma
    with pytest.raises(CaptureError, match="stock Megatron-LM's pretrain_gpt.py cannot build"):
        megatron_args_for(argv, gpus=8, gpu_memory_gib=80, device="fake", progress=False)
