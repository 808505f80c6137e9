"""The mixture-of-experts part of Hugging Face configs (mixtral, qwen2_moe, qwen3_moe, and the
routed / shared experts of deepseek_v2 / deepseek_v3, whose multi-latent attention is refused by
capture_megatron.config.hf) in Megatron-LM's MoE flags. Pure Python.

- Which layers are MoE layers: Mixtral every layer; Qwen's layer i unless i is in mlp_only_layers
  or (i + 1) % decoder_sparse_step != 0; DeepSeek's from first_k_dense_replace on. Written as
  Megatron-LM's --moe-layer-freq ("1", or a list expression such as "([0]*3+[1]*58)").
- Routed experts' width: intermediate_size (Mixtral), moe_intermediate_size (Qwen, DeepSeek); the
  dense layers keep intermediate_size.
- Shared experts: Qwen2-MoE's shared_expert_intermediate_size with its sigmoid gate
  (--moe-shared-expert-gate); DeepSeek's n_shared_experts x moe_intermediate_size.
- Routing: top num_experts_per_tok; router_aux_loss_coef as --moe-aux-loss-coeff; Qwen's
  norm_topk_prob false (softmax over all experts, not renormalised) as --moe-router-pre-softmax;
  DeepSeek's scoring_func as --moe-router-score-function and its seq_aux as
  --moe-router-load-balancing-type seq_aux_loss (how NVIDIA's DeepSeek-V3 script routes). Its
  group-limited routing and score-correction bias (E floats per layer) only choose which experts
  get tokens, as the Megatron flags for them do (rules/flags.py).
  Routing is dropless, as in transformers (no capacity factor).
"""

from __future__ import annotations

from typing import Any

from capture_megatron.features.moe import Experts

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
"""HF model types with experts."""


def layer_freq(pattern: list[bool]) -> str:
    """Megatron-LM's --moe-layer-freq for a per-layer pattern: "1" when every layer is an MoE
    layer, else a list expression of runs, e.g. "([0]*3+[1]*58)"."""
    if all(pattern):
        return "1"
    runs: list[list[int]] = []
    for moe in pattern:
        if runs and runs[-1][0] == int(moe):
            runs[-1][1] += 1
        else:
            runs.append([int(moe), 1])
    return "(" + "+".join(f"[{v}]*{n}" for v, n in runs) + ")"


def _pattern(cfg: dict[str, Any], kind: str) -> list[bool]:
    layers = cfg["num_hidden_layers"]
    if kind == "mixtral":
        return [True] * layers
    if kind.startswith("deepseek"):
        first = cfg.get("first_k_dense_replace", 3 if kind == "deepseek_v3" else 0)
        return [i >= first for i in range(layers)]
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def experts_of(cfg: dict[str, Any], kind: str) -> Experts:
    """The Experts of a config of one of MOE_TYPES (transformers v4.57.1's defaults for the fields
    it leaves out: configuration_<type>.py)."""
    qwen = kind.startswith("qwen")
    if kind == "mixtral":
        count, topk, width = cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2), 0
    elif qwen:
        count = cfg.get("num_experts", 60 if kind == "qwen2_moe" else 128)
        topk = cfg.get("num_experts_per_tok", 4 if kind == "qwen2_moe" else 8)
        width = cfg.get("moe_intermediate_size", 1408 if kind == "qwen2_moe" else 768)
    else:
        count, topk = cfg.get("n_routed_experts", 256), cfg.get("num_experts_per_tok", 8)
        width = cfg.get("moe_intermediate_size", 2048)
    shared, gate = 0, False
    if kind == "qwen2_moe":
        shared, gate = cfg.get("shared_expert_intermediate_size", 5632), True
    elif kind.startswith("deepseek"):
        shared = (cfg.get("n_shared_experts") or 0) * width
    deepseek = kind.startswith("deepseek")
    return Experts(
        num_experts=count,
        moe_router_topk=topk,
        moe_ffn_hidden_size=width,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=gate,
        moe_layer_freq=layer_freq(_pattern(cfg, kind)),
        moe_aux_loss_coeff=_aux_loss(cfg, kind),
        moe_router_pre_softmax=qwen and not cfg.get("norm_topk_prob", False),
        moe_router_score_function=_score_function(cfg, kind) if deepseek else "softmax",
        # DeepSeek's gate computes its logits in fp32, as Megatron-Bridge's deepseek_v2 / v3
        # bridges set (moe_router_dtype "fp32"); Mixtral's and Qwen's in the model's dtype
        moe_router_dtype="fp32" if deepseek else "",
        moe_router_load_balancing_type="seq_aux_loss"
        if deepseek and cfg.get("seq_aux")
        else "aux_loss",
        # DeepSeek's group-limited routing (n_group, topk_group; "greedy" routing has none)
        moe_router_num_groups=_groups(cfg, "n_group") if deepseek else 0,
        moe_router_group_topk=_groups(cfg, "topk_group") if deepseek else 0,
    )


def _groups(cfg: dict[str, Any], key: str) -> int:
    """DeepSeek's n_group / topk_group where its topk_method limits groups (V3's noaux_tc, V2's
    group_limited_greedy), else 0."""
    if cfg.get("topk_method", "greedy") == "greedy" or (cfg.get("n_group") or 1) <= 1:
        return 0
    return int(cfg.get(key) or 0)


def _score_function(cfg: dict[str, Any], kind: str) -> str:
    """DeepSeek's scoring_func (transformers' default: sigmoid for V3, softmax for V2)."""
    return str(cfg.get("scoring_func", "sigmoid" if kind == "deepseek_v3" else "softmax"))


def _aux_loss(cfg: dict[str, Any], kind: str) -> float:
    """router_aux_loss_coef (Mixtral, Qwen; default 0.001), DeepSeek's aux_loss_alpha (default
    0)."""
    if kind.startswith("deepseek"):
        return float(cfg.get("aux_loss_alpha") or 0.0)
    return float(cfg.get("router_aux_loss_coef", 0.001))


def expert_parameters(shape: Any) -> tuple[int, int]:
    """(parameters of one MoE layer's MLP part: router, routed experts, shared experts and gate;
    parameters of a dense layer's MLP) for a ModelShape with experts."""
    h, gate, moe = shape.hidden_size, 2 if shape.gated else 1, shape.moe
    routed = moe.num_experts * (gate * h * shape.moe_ffn + shape.moe_ffn * h)
    fs = moe.moe_shared_expert_intermediate_size
    shared = gate * h * fs + fs * h + (h if moe.moe_shared_expert_gate else 0)
    dense = gate * h * shape.ffn + shape.ffn * h
    return moe.num_experts * h + routed + shared, dense
