"""`predict` and `plan` on bad Megatron-LM command lines and on Hugging Face configs of models that
are not modelled (issue 12, must-show 5): one paragraph naming the offending flag or field, exit 2,
no traceback. Everything here fails before any profiling starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_errors import cli, one_error

from capture_megatron.config.hf import from_hf_config
from capture_megatron.errors import CaptureError

HF = Path(__file__).parents[1] / "data" / "hf_configs"
GPT = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 --vocab-size 512 "
    "--gpus 8 --no-progress"
)

TYPOS = {
    "num_layer": ("--num-layer 4", "--num-layer", "did you mean --num-layers"),
    "backend": (
        "--attention-backnd flash",
        "--attention-backnd",
        "did you mean --attention-backend",
    ),
    "tp": (
        "--tensor-model-paralel-size 2",
        "--tensor-model-paralel-size",
        "did you mean --tensor-model-parallel-size",
    ),
    "recompute": (
        "--recompute-granularty full",
        "--recompute-granularty",
        "did you mean --recompute-granularity",
    ),
}
UNMODELLED = {
    "moe_grouped_bias": (
        "--num-experts 8 --moe-grouped-gemm",
        "--moe-grouped-gemm with linear biases is not modelled on the GPU kernel set",
    ),
    "cp_a2a": (
        "--context-parallel-size 2 --cp-comm-type a2a",
        "--cp-comm-type a2a is not modelled: the GPU memory model emulates",
    ),
    "cp_unfused": (
        "--context-parallel-size 2 --attention-backend unfused",
        "--attention-backend unfused is not modelled",
    ),
    "fp4": ("--fp4-format e2m1", "--fp4-format e2m1"),
    "fsdp2": ("--use-torch-fsdp2", "--use-torch-fsdp2"),
}
MISFITS = {
    # name: (command, extra flags, what the one paragraph names)
    "experts_ep": (
        "predict",
        "--num-experts 6 --expert-model-parallel-size 4 --disable-bias-linear",
        "experts 6 not divisible by EP 4 (EP can be one of 1, 2, 3, 6)",
    ),
    "ep_etp_world": (
        "predict",
        "--num-experts 8 --expert-model-parallel-size 4 --expert-tensor-parallel-size 4",
        "EP 4 x ETP 4 does not divide the 8 ranks of a pipeline stage",
    ),
    "cp_seq": (
        "predict",
        "--context-parallel-size 4 --seq-length 36 --max-position-embeddings 36",
        "seq length 36 not divisible by 2 x CP 4",
    ),
}


@pytest.mark.parametrize("name", sorted(MISFITS))
def test_expert_and_context_misfits_are_one_paragraph(name, tmp_path):
    command, extra, shown = MISFITS[name]
    argv = [command, *GPT.split(), *extra.split()]
    if command == "plan":
        argv += ["--gpu-memory-gib", "80"]
    line = one_error(cli(argv, str(tmp_path)), command)
    assert shown in line, line


REFUSED_HF = {
    "Phi-3-mini-128k-instruct": ("rope_scaling type 'longrope'",),
}


@pytest.mark.parametrize("command", ["predict", "plan"])
@pytest.mark.parametrize("name", sorted(TYPOS))
def test_typos_get_the_closest_flag(command, name, tmp_path):
    extra, typo, hint = TYPOS[name]
    argv = [command, *GPT.split(), *extra.split()]
    if command == "plan":
        argv += ["--gpu-memory-gib", "80"]
    line = one_error(cli(argv, str(tmp_path)), command)
    assert typo in line and hint in line, line


@pytest.mark.parametrize("command", ["predict", "plan"])
@pytest.mark.parametrize("name", sorted(UNMODELLED))
def test_unmodelled_features_are_refused_by_name(command, name, tmp_path):
    extra, shown = UNMODELLED[name]
    argv = [command, *GPT.split(), *extra.split()]
    if command == "plan":
        argv += ["--gpu-memory-gib", "80"]
    line = one_error(cli(argv, str(tmp_path)), command)
    assert shown in line and "not model" in line, line


@pytest.mark.parametrize("name", sorted(REFUSED_HF))
def test_longrope_hf_config_is_refused(name, tmp_path):
    argv = ["plan", "--hf-config", str(HF / f"{name}.json"), "--gpus", "8"]
    line = one_error(cli([*argv, "--gpu-memory-gib", "80", "--no-progress"], str(tmp_path)), "plan")
    for part in REFUSED_HF[name]:
        assert part in line, line
    with pytest.raises(CaptureError):
        from_hf_config(str(HF / f"{name}.json"))


def test_dense_hf_configs_map_exactly():
    llama = from_hf_config(str(HF / "Meta-Llama-3-8B.json"))
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size) == (32, 4096, 14336)
    assert (llama.num_query_groups, llama.vocab_size, llama.seq_length) == (8, 128256, 4096)
    assert llama.swiglu and llama.untie_embeddings_and_output_weights and not llama.add_bias_linear
    mistral = from_hf_config(str(HF / "Mistral-7B-v0.1.json"))  # window 4096 = the sequence
    assert mistral.num_query_groups == 8 and mistral.max_position_embeddings == 32768
    assert mistral.window_size == ()
    longer = from_hf_config(str(HF / "Mistral-7B-v0.1.json"), seq_length=8192)
    assert longer.window_size == (4096, 0)  # Megatron-LM's --window-size 4096,0
    qwen2 = from_hf_config(str(HF / "Qwen2-7B.json"))
    assert qwen2.add_qkv_bias and not qwen2.add_bias_linear and qwen2.rotary_base == 1000000
