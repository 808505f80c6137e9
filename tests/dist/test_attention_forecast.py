"""The per-rank forecast of runs with query/key norms and multi-latent attention on the CPU
(issue 26, must-show 2): Qwen3's attention (--qk-layernorm on RMSNorm, GQA, RoPE) and DeepSeek's
(MLA with a query latent, latent norms and YaRN; MLA without one, plain RoPE, full recompute) over
TP 2 with sequence parallelism, TP 2 x PP 2 and PP 2: every rank's predicted peak is within 2% of
what it measures. Real torchrun + gloo, megatron-core's SelfAttention / MLASelfAttention from its
local spec."""

from __future__ import annotations

from harness import SMALL_SHAPE, verify_on_cpu

BASE = [
    *SMALL_SHAPE,
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--position-embedding-type",
    "rope",
    "--num-virtual-stages-per-pipeline-rank",
    "1",
]
TP2_PP2 = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--recompute-granularity",
    "none",
]
MLA = [
    "--multi-latent-attention",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "12",
]


def _verify(flags: list[str], tmp_path, nproc: int) -> dict:
    return verify_on_cpu(flags, tmp_path, nproc)


def test_qk_layernorm_is_forecast_within_2_percent(tmp_path):
    gqa = ["--qk-layernorm", "--group-query-attention", "--num-query-groups", "2"]
    tp2 = TP2_PP2[:2] + ["--pipeline-model-parallel-size", "1"] + TP2_PP2[4:]
    result = _verify(BASE + tp2 + gqa, tmp_path, nproc=2)
    print(f"QK layernorm TP2 + SP: max prediction error {100 * result['max_abs_error']:.2f}%")
    assert (result["plan"]["tp"], result["plan"]["pp"]) == (2, 1)
    assert result["max_abs_error"] <= 0.02


def test_mla_with_query_latent_is_forecast_within_2_percent(tmp_path):
    """q_lora_rank > 0 with --qk-layernorm (the latents' norms), YaRN scaling (values only)."""
    latent = ["--q-lora-rank", "32", "--qk-layernorm", "--rotary-scaling-factor", "40"]
    result = _verify(BASE + TP2_PP2 + MLA + latent, tmp_path, nproc=4)
    print(f"MLA TP2 x PP2 + SP: max prediction error {100 * result['max_abs_error']:.2f}%")
    assert (result["plan"]["tp"], result["plan"]["pp"]) == (2, 2)
    assert result["max_abs_error"] <= 0.02


def test_mla_without_query_latent_under_recompute_is_forecast_within_2_percent(tmp_path):
    """q_lora_rank 0 (the query projected directly), plain RoPE, no latent norms, PP 2 with the
    first layer of each stage fully recomputed."""
    sizes = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"]
    recompute = ["--recompute-granularity", "full", "--recompute-method", "block"]
    plain = ["--q-lora-rank", "0", "--rope-type", "rope", "--recompute-num-layers", "1"]
    result = _verify(BASE + MLA + sizes + recompute + plain, tmp_path, nproc=2)
    print(f"MLA PP2 recompute: max prediction error {100 * result['max_abs_error']:.2f}%")
    assert result["plan"]["pp"] == 2
    assert result["max_abs_error"] <= 0.02
